;; its allocator returns an address past the end of memory.
(module
  (memory (export "memory") 1)
  (func (export "rewind_abi_version") (result i32) i32.const 1)
  (func (export "rewind_alloc") (param i32) (result i32) i32.const 0x7fff0000)
  (func (export "rewind_classify") (param i32 i32) (result i64) i64.const 0))
