;; An example rewind policy written by hand in WebAssembly text, to show the
;; ABI (policy/ABI.md) needs nothing from Go. It implements the same rule as
;; the built-in "effects" policy, reading the report's counters at their fixed
;; offsets in the wire encoding, with fixed reasons.
;;
;; Build: wat2wasm policy.wat -o policy.wasm
;; Try:   rewind policy test policy.wasm --reports ../../policies/testdata/reports.jsonl \
;;          --expect ../../policies/testdata/expect-effects.jsonl
(module
  (memory (export "memory") 1)

  ;; Outputs: a decision byte (0 skip, 1 fs, 2 full, 0xff error), then the reason.
  (data (i32.const 16)  "\02probe lost events")              ;; 18 bytes
  (data (i32.const 48)  "\02new long-lived processes")       ;; 25 bytes
  (data (i32.const 80)  "\02pre-existing processes exited")  ;; 30 bytes
  (data (i32.const 112) "\02memory written")                 ;; 15 bytes
  (data (i32.const 144) "\02cwd changed")                    ;; 12 bytes
  (data (i32.const 160) "\01files changed only")             ;; 19 bytes
  (data (i32.const 192) "\00no lasting effects")             ;; 19 bytes
  (data (i32.const 224) "\ffmalformed or unknown report")    ;; 28 bytes

  ;; The input buffer starts at 1024 and may extend to the end of memory.
  (global $in i32 (i32.const 1024))

  (func (export "rewind_abi_version") (result i32) (i32.const 1))

  ;; rewind_alloc(n): make room for n bytes at $in, growing memory if needed.
  (func (export "rewind_alloc") (param $n i32) (result i32)
    (local $pages i32)
    (local.set $pages
      (i32.shr_u (i32.add (i32.add (global.get $in) (local.get $n)) (i32.const 65535)) (i32.const 16)))
    (if (i32.gt_u (local.get $pages) (memory.size))
      (then
        (if (i32.eq (memory.grow (i32.sub (local.get $pages) (memory.size))) (i32.const -1))
          (then (return (i32.const 0))))))
    (global.get $in))

  ;; out(ptr, len) packs the result: ptr in the high 32 bits, len in the low.
  (func $out (param $ptr i32) (param $len i32) (result i64)
    (i64.or (i64.shl (i64.extend_i32_u (local.get $ptr)) (i64.const 32))
            (i64.extend_i32_u (local.get $len))))

  ;; counter(p, i) reads counter i: offset 8 + 8*i.
  (func $counter (param $p i32) (param $i i32) (result i64)
    (i64.load (i32.add (local.get $p) (i32.add (i32.const 8) (i32.shl (local.get $i) (i32.const 3))))))

  (func (export "rewind_classify") (param $p i32) (param $n i32) (result i64)
    ;; Header: at least 8 + 24*8 bytes, magic "RW", wire version 1, >= 24 counters.
    (if (i32.or
          (i32.or (i32.lt_u (local.get $n) (i32.const 200))
                  (i32.ne (i32.load16_u (local.get $p)) (i32.const 0x5752)))
          (i32.or (i32.ne (i32.load8_u offset=2 (local.get $p)) (i32.const 1))
                  (i32.lt_u (i32.load offset=4 (local.get $p)) (i32.const 24))))
      (then (return (call $out (i32.const 224) (i32.const 28)))))
    ;; 3 LostEvents
    (if (i64.ne (call $counter (local.get $p) (i32.const 3)) (i64.const 0))
      (then (return (call $out (i32.const 16) (i32.const 18)))))
    ;; 14 Proc.NewLongLived
    (if (i64.ne (call $counter (local.get $p) (i32.const 14)) (i64.const 0))
      (then (return (call $out (i32.const 48) (i32.const 25)))))
    ;; 12 Proc.Exited: processes alive at turn start and gone at its end
    ;; (processes born and reaped within the turn are not counted).
    (if (i64.ne (call $counter (local.get $p) (i32.const 12)) (i64.const 0))
      (then (return (call $out (i32.const 80) (i32.const 30)))))
    ;; 17 Mem.PagesWritten
    (if (i64.ne (call $counter (local.get $p) (i32.const 17)) (i64.const 0))
      (then (return (call $out (i32.const 112) (i32.const 15)))))
    ;; 15 Proc.CwdChanges
    (if (i64.ne (call $counter (local.get $p) (i32.const 15)) (i64.const 0))
      (then (return (call $out (i32.const 144) (i32.const 12)))))
    ;; 4..9 FS counters
    (if (i64.ne
          (i64.or
            (i64.or (i64.or (call $counter (local.get $p) (i32.const 4)) (call $counter (local.get $p) (i32.const 5)))
                    (i64.or (call $counter (local.get $p) (i32.const 6)) (call $counter (local.get $p) (i32.const 7))))
            (i64.or (call $counter (local.get $p) (i32.const 8)) (call $counter (local.get $p) (i32.const 9))))
          (i64.const 0))
      (then (return (call $out (i32.const 160) (i32.const 19)))))
    (call $out (i32.const 192) (i32.const 19))))
