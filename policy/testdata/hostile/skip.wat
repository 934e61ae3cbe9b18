;; well-behaved: always says skip (with reason "ok"). Used to check that lost
;; events override a skip.
(module
  (memory (export "memory") 1)
  (func (export "rewind_abi_version") (result i32) i32.const 1)
  (func (export "rewind_alloc") (param i32) (result i32) i32.const 1024)
  (data (i32.const 16) "\00ok")
  (func (export "rewind_classify") (param i32 i32) (result i64)
    i64.const 0x0000001000000003))
