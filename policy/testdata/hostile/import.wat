;; imports a host function the host does not offer.
(module
  (import "env" "open_host_file" (func $evil (param i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "rewind_abi_version") (result i32) i32.const 1)
  (func (export "rewind_alloc") (param i32) (result i32) i32.const 1024)
  (func (export "rewind_classify") (param i32 i32) (result i64)
    (drop (call $evil (i32.const 0)))
    i64.const 1))
