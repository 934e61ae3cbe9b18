;; lacks rewind_classify.
(module
  (memory (export "memory") 1)
  (func (export "rewind_abi_version") (result i32) i32.const 1)
  (func (export "rewind_alloc") (param i32) (result i32) i32.const 1024))
