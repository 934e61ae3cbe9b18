;; reports an error (code 0xFF) with a message.
(module
  (memory (export "memory") 1)
  (func (export "rewind_abi_version") (result i32) i32.const 1)
  (func (export "rewind_alloc") (param i32) (result i32) i32.const 1024)
  (data (i32.const 16) "\ffcannot parse")
  (func (export "rewind_classify") (param i32 i32) (result i64)
    i64.const 0x000000100000000D))
