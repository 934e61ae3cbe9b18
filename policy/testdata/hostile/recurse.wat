;; recurses without bound from classify: the stack overflows.
(module
  (memory (export "memory") 1)
  (func $down (param i32) (result i32)
    (call $down (i32.add (local.get 0) (i32.const 1))))
  (func (export "rewind_abi_version") (result i32) i32.const 1)
  (func (export "rewind_alloc") (param i32) (result i32) i32.const 1024)
  (func (export "rewind_classify") (param i32 i32) (result i64)
    (i64.extend_i32_u (call $down (i32.const 0)))))
