;; asks for 1 GiB of memory up front.
(module
  (memory (export "memory") 16384)
  (func (export "rewind_abi_version") (result i32) i32.const 1)
  (func (export "rewind_alloc") (param i32) (result i32) i32.const 1024)
  (func (export "rewind_classify") (param i32 i32) (result i64) i64.const 0))
