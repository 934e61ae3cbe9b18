;; never finishes _initialize.
(module
  (memory (export "memory") 1)
  (func (export "_initialize") (loop $l (br $l)))
  (func (export "rewind_abi_version") (result i32) i32.const 1)
  (func (export "rewind_alloc") (param i32) (result i32) i32.const 1024)
  (func (export "rewind_classify") (param i32 i32) (result i64) i64.const 0))
