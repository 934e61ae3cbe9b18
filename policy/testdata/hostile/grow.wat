;; classify grows memory without bound, then spins: memory.grow must fail at
;; the host's limit and the deadline must end the call.
(module
  (memory (export "memory") 1)
  (func (export "rewind_abi_version") (result i32) i32.const 1)
  (func (export "rewind_alloc") (param i32) (result i32) i32.const 1024)
  (func (export "rewind_classify") (param i32 i32) (result i64)
    (loop $grow
      (drop (memory.grow (i32.const 16)))
      (br $grow))
    i64.const 0))
