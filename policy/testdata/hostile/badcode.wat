;; returns decision code 7, which the ABI does not define.
(module
  (memory (export "memory") 1)
  (func (export "rewind_abi_version") (result i32) i32.const 1)
  (func (export "rewind_alloc") (param i32) (result i32) i32.const 1024)
  (data (i32.const 16) "\07")
  (func (export "rewind_classify") (param i32 i32) (result i64)
    i64.const 0x0000001000000001))
