package criu

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// MissingFile finds the file a restore could not open in CRIU's log, and
// only that failure of a restore.
func TestMissingFile(t *testing.T) {
	for _, tc := range []struct {
		name, log, op string
		want          string
	}{
		{"tmpfs file", "(00.01) Collected [usr/bin/bash] ID 0x1\n(00.02) Error (criu/files-reg.c:2353): Can't open file dev/shm/ro on restore: No such file or directory\n", "restore", "/dev/shm/ro"},
		{"other error", "(00.02) Error (criu/cr-restore.c:1230): Can't fork for 24: File exists\n", "restore", ""},
		{"permission", "(00.02) Error (criu/files-reg.c:2353): Can't open file w/x on restore: Permission denied\n", "restore", ""},
		{"dump", "(00.02) Error (criu/files-reg.c:2353): Can't open file w/x on restore: No such file or directory\n", "dump", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			log := filepath.Join(t.TempDir(), "restore.log")
			if err := os.WriteFile(log, []byte(tc.log), 0o644); err != nil {
				t.Fatal(err)
			}
			err := fmt.Errorf("restore p-1: %w", &Error{Op: tc.op, Log: log, Err: errors.New("operation failed")})
			got, ok := MissingFile(err)
			if got != tc.want || ok != (tc.want != "") {
				t.Fatalf("MissingFile = %q, %v; want %q", got, ok, tc.want)
			}
		})
	}
	if _, ok := MissingFile(errors.New("plain")); ok {
		t.Fatal("a plain error is a missing file")
	}
}
