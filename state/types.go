// Package state is rewind's state manager: it owns every sandbox and the
// checkpoint tree (a DAG once forks share ancestors), keeps their metadata in
// a crash-safe bbolt store, orders operations per sandbox, and drives the
// file-system and process back ends through the narrow interfaces in
// backend.go. It holds no Linux specifics: the daemon wires the real fs,
// sandbox, cr, probe and policy packages in through adapters.
//
// Invariants kept here:
//   - every checkpoint is one (fs, processes) pair taken in one freeze window;
//   - a restore switches the fs first, then the processes, and is
//     all-or-nothing: on any failure the sandbox stays exactly as it was;
//   - a restore bumps the sandbox's epoch, and calls carrying an older epoch
//     are rejected with ErrStaleEpoch;
//   - GC frees only checkpoints unreachable from pins and sandbox heads
//     (following parent links), so nothing a search can return to is freed.
package state

import (
	"errors"
	"time"
)

// Mode is a checkpoint decision: what a turn saves.
type Mode string

// The decisions a turn can take. ModeAuto asks the probe and policy.
const (
	ModeAuto Mode = "auto"
	ModeSkip Mode = "skip"
	ModeFS   Mode = "fs"
	ModeFull Mode = "full"
)

// ParseMode validates a mode name ("" means auto).
func ParseMode(s string) (Mode, error) {
	switch Mode(s) {
	case "", ModeAuto:
		return ModeAuto, nil
	case ModeSkip, ModeFS, ModeFull:
		return Mode(s), nil
	}
	return "", &Error{Code: CodeBadRequest, Msg: "unknown mode " + s + " (want auto, skip, fs or full)"}
}

// Sandbox status values.
const (
	// StatusRunning: the sandbox's fs is mounted and its processes run.
	StatusRunning = "running"
	// StatusStopped: the sandbox has no live fs or processes (for example
	// after a daemon restart); a restore brings it back.
	StatusStopped = "stopped"
)

// Checkpoint status values.
const (
	// CkptPending: the id was handed out, the work has not finished.
	CkptPending = "pending"
	// CkptReady: restorable in this daemon's life (fs layer + fast process part).
	CkptReady = "ready"
	// CkptFailed: the checkpoint could not be taken; it is not in the tree.
	CkptFailed = "failed"
)

// Sandbox is the persistent description of one sandbox.
type Sandbox struct {
	ID     string   `json:"id"`
	Name   string   `json:"name"`
	Bases  []string `json:"bases,omitempty"`
	FSKind string   `json:"fs"`
	Policy string   `json:"policy,omitempty"`
	Status string   `json:"status"`
	Epoch  uint64   `json:"epoch"`
	// EpochLimit bounds every epoch handed out while this record was the
	// stored one: restores write their new epoch in the background, so
	// after a crash the store may hold an older epoch than a client saw,
	// and recovery continues above EpochLimit.
	EpochLimit uint64    `json:"epoch_limit,omitempty"`
	Head       string    `json:"head,omitempty"`
	Turns      uint64    `json:"turns"`
	Created    time.Time `json:"created"`
	// Origin is the checkpoint a forked sandbox was created from.
	Origin string `json:"origin,omitempty"`
	// Copy is the copy number of a forked sandbox (1..N), 0 otherwise.
	Copy int `json:"copy,omitempty"`
	// Note explains the status (for example why a sandbox is stopped).
	Note string `json:"note,omitempty"`
	// Warm marks a fork child prepared ahead of a fork and not handed out
	// yet (see Config.WarmForks); it is never listed.
	Warm bool `json:"warm,omitempty"`
}

// ProcPart is the process half of a checkpoint, as the process back end
// describes it. The state manager only stores it and hands it back.
type ProcPart struct {
	// Templates names the live template processes (fast restore path).
	Templates []string `json:"templates,omitempty"`
	// TemplateReady is true while the templates exist.
	TemplateReady bool `json:"template_ready"`
	// ImageDir is the CRIU image directory (durable restore path).
	ImageDir string `json:"image_dir,omitempty"`
	// ImageReady is true once the images are completely written.
	ImageReady bool `json:"image_ready"`
	// Processes is the number of processes captured.
	Processes int `json:"processes"`
	// Bytes is the memory the part holds (template RSS or image size).
	Bytes int64 `json:"bytes"`
	// FrozenUS is how long the processes were stopped to take it.
	FrozenUS int64 `json:"frozen_us"`
	// Data is opaque back-end data.
	Data map[string]string `json:"data,omitempty"`
}

// Restorable reports whether some restore path exists for the part.
func (p *ProcPart) Restorable() bool { return p != nil && (p.TemplateReady || p.ImageReady) }

// Checkpoint is one node of the checkpoint tree.
type Checkpoint struct {
	ID      string `json:"id"`
	Parent  string `json:"parent,omitempty"`
	Sandbox string `json:"sandbox"`
	// Seq is the checkpoint's number within its sandbox, from 1.
	Seq      uint64 `json:"seq"`
	Decision Mode   `json:"decision"`
	// Decided is set to skip when the policy's decision for the turn that
	// made this checkpoint was to skip it, yet the checkpoint is an fs one
	// (freezing nothing new if nothing changed) because the turn had
	// handed out its id already: a deferred turn's skip, and a full
	// decision that, on the report without the provably unchanged
	// processes' memory and cwd effects, became skip.
	Decided Mode   `json:"decided,omitempty"`
	Reason  string `json:"reason,omitempty"`
	Status  string `json:"status"`
	Error   string `json:"error,omitempty"`
	// FS is the file-system back end's checkpoint id.
	FS string `json:"fs,omitempty"`
	// ProcFrom is the id of the checkpoint whose process part this one
	// uses: itself for a full checkpoint, the nearest full ancestor for an
	// fs-only one.
	ProcFrom string    `json:"proc_from,omitempty"`
	Proc     *ProcPart `json:"proc,omitempty"`
	// Durable is true once everything needed to restore after a host
	// reboot is on disk.
	Durable bool `json:"durable"`
	// Restorable is false when no restore path remains (for example a
	// template-only part after a host reboot).
	Restorable bool      `json:"restorable"`
	Created    time.Time `json:"created"`
	FrozenUS   int64     `json:"frozen_us"`
	TookUS     int64     `json:"took_us"`
	FSBytes    int64     `json:"fs_bytes"`
	Epoch      uint64    `json:"epoch"`
}

// Error is a state error with a stable code the API maps to a status.
type Error struct {
	Code string
	Msg  string
	Err  error
}

// Error codes.
const (
	CodeNotFound   = "not_found"
	CodeExists     = "exists"
	CodeBadRequest = "bad_request"
	CodeStaleEpoch = "stale_epoch"
	CodeNotReady   = "not_ready"
	CodeConflict   = "conflict"
	CodeInternal   = "internal"
)

func (e *Error) Error() string {
	if e.Err != nil {
		return e.Msg + ": " + e.Err.Error()
	}
	return e.Msg
}

func (e *Error) Unwrap() error { return e.Err }

// Is matches errors by code, so errors.Is(err, ErrStaleEpoch) works.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Msg == "" && t.Code == e.Code
}

// Sentinels for errors.Is.
var (
	ErrNotFound   = &Error{Code: CodeNotFound}
	ErrExists     = &Error{Code: CodeExists}
	ErrStaleEpoch = &Error{Code: CodeStaleEpoch}
	ErrNotReady   = &Error{Code: CodeNotReady}
	ErrBadRequest = &Error{Code: CodeBadRequest}
	ErrConflict   = &Error{Code: CodeConflict}
)

// CodeOf returns the code of a state error, or CodeInternal.
func CodeOf(err error) string {
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return CodeInternal
}

func errf(code, msg string, err error) error { return &Error{Code: code, Msg: msg, Err: err} }
