;; grows its memory one page at a time until memory.grow fails, then reports
;; how far it got: fs if it reached exactly 128 pages (8 MiB), skip if exactly
;; 256 pages (16 MiB), full otherwise. Used to check the host's memory limit.
(module
  (memory (export "memory") 1)
  (data (i32.const 16) "\01at 128 pages")
  (data (i32.const 32) "\00at 256 pages")
  (data (i32.const 48) "\02other")
  (func (export "rewind_abi_version") (result i32) i32.const 1)
  (func (export "rewind_alloc") (param i32) (result i32) i32.const 1024)
  (func (export "rewind_classify") (param i32 i32) (result i64)
    (block $full
      (loop $grow
        (br_if $grow (i32.ne (memory.grow (i32.const 1)) (i32.const -1))))
      (if (i32.eq (memory.size) (i32.const 128))
        (then (return (i64.const 0x000000100000000D))))
      (if (i32.eq (memory.size) (i32.const 256))
        (then (return (i64.const 0x000000200000000D)))))
    (i64.const 0x0000003000000006)))
