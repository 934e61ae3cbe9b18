// Package api holds the request and response bodies of rewind's HTTP/JSON
// API (version 1, every path under /v1). The daemon serves it over a
// root-only unix socket; package client calls it. README.md in this
// directory is the reference.
package api

import (
	"github.com/rewind-sandbox/rewind/state"
)

// Version is the API version, the first element of every path.
const Version = "v1"

// DefaultSocket is where the daemon listens unless told otherwise.
const DefaultSocket = "/run/rewind/rewind.sock"

// DefaultStateDir is where the daemon keeps its state unless told otherwise.
const DefaultStateDir = "/var/lib/rewind"

// StateRecord is the file beside a daemon's socket that names the state
// dir of the last daemon that listened there (written at its start, kept
// after it stops or dies): a client that finds no daemon on the socket
// starts one on that state dir again, not on another.
func StateRecord(socket string) string { return socket + ".state" }

// Error is the body of every non-2xx answer.
type Error struct {
	Error ErrorBody `json:"error"`
}

// ErrorBody carries a stable code (see state.Code*) and a one-line message.
type ErrorBody struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// VersionInfo answers GET /v1/version.
type VersionInfo struct {
	Version string `json:"version"`
	API     string `json:"api"`
	PID     int    `json:"pid"`
	// Backends says which back ends the daemon runs with.
	Backends map[string]string `json:"backends"`
	StateDir string            `json:"state_dir"`
}

// CreateRequest is the body of POST /v1/sandboxes.
type CreateRequest struct {
	Name   string   `json:"name"`
	Bases  []string `json:"bases,omitempty"`
	FS     string   `json:"fs,omitempty"`
	Policy string   `json:"policy,omitempty"`
}

// SandboxList answers GET /v1/sandboxes.
type SandboxList struct {
	Sandboxes []*state.Sandbox `json:"sandboxes"`
}

// ExecRequest is the body of POST /v1/sandboxes/{name}/exec. The answer is
// a stream of ExecFrame objects, one JSON object per line, ending with one
// that has Exit or Error set.
type ExecRequest struct {
	Argv  []string `json:"argv"`
	Env   []string `json:"env,omitempty"`
	Dir   string   `json:"dir,omitempty"`
	Stdin string   `json:"stdin,omitempty"`
	// StdinB64 is the command's standard input as bytes (base64 in
	// JSON), for input that is not UTF-8 text; at most one of Stdin and
	// StdinB64 may be set.
	StdinB64 []byte `json:"stdin_b64,omitempty"`
	Epoch    uint64 `json:"epoch,omitempty"`
}

// ExecFrame is one line of an exec stream. A chunk of output that is not
// valid UTF-8 (binary output, or a character split between two chunks)
// comes in StdoutB64 or StderrB64 as well, exactly (base64 in JSON); its
// Stdout or Stderr then holds the text JSON can carry, with U+FFFD for
// the bytes it cannot.
type ExecFrame struct {
	Stdout    string     `json:"stdout,omitempty"`
	Stderr    string     `json:"stderr,omitempty"`
	StdoutB64 []byte     `json:"stdout_b64,omitempty"`
	StderrB64 []byte     `json:"stderr_b64,omitempty"`
	Exit      *int       `json:"exit,omitempty"`
	Error     *ErrorBody `json:"error,omitempty"`
}

// Bytes returns the frame's output bytes, exactly, and whether they are
// standard error's.
func (f *ExecFrame) Bytes() (b []byte, stderr bool) {
	switch {
	case f.StdoutB64 != nil:
		return f.StdoutB64, false
	case f.StderrB64 != nil:
		return f.StderrB64, true
	case f.Stderr != "":
		return []byte(f.Stderr), true
	}
	return []byte(f.Stdout), false
}

// SessionRequest is the body of POST /v1/sandboxes/{name}/sessions.
type SessionRequest struct {
	ID    string   `json:"id,omitempty"`
	Argv  []string `json:"argv"`
	Env   []string `json:"env,omitempty"`
	Epoch uint64   `json:"epoch,omitempty"`
}

// SessionList answers GET /v1/sandboxes/{name}/sessions: the ids of the
// sessions whose process runs.
type SessionList struct {
	Sessions []string `json:"sessions"`
}

// SessionInfo answers a session start.
type SessionInfo struct {
	ID string `json:"id"`
}

// SendRequest is the body of POST /v1/sandboxes/{name}/sessions/{id}/send.
//
// Restore and Turn make one call of a tree-search step (go back to a
// node, run the next action, end the turn): the daemon restores, sends,
// then ends the turn, in that order, as the three calls would, without
// the round trips between them. A bad request (a bad turn mode among
// them) is refused before any step runs. Each step runs only if the one
// before it succeeded; an error answer names the step that failed, and the
// steps before it stay done (a failed send leaves the sandbox restored; a
// failed turn leaves the text sent, and its output is lost with the
// answer).
type SendRequest struct {
	// Restore, when set, first restores the sandbox to this checkpoint
	// (as POST .../restore). Epoch then applies to the restore; the text
	// goes to the session of the restored state, and the turn, if any, is
	// bound to the restore's new epoch.
	Restore string `json:"restore,omitempty"`
	// Turn, when set, ends the turn once the answer is read (as POST
	// .../turn with this body; its own Epoch must be 0: the send's
	// applies).
	Turn *TurnRequest `json:"turn,omitempty"`
	Text string       `json:"text"`
	// IdleMS ends the read after this much quiet output (default 300).
	IdleMS int `json:"idle_ms,omitempty"`
	// Until is a regular expression that ends the read when matched.
	Until string `json:"until,omitempty"`
	// TimeoutMS bounds the call (default 60000).
	TimeoutMS int    `json:"timeout_ms,omitempty"`
	Epoch     uint64 `json:"epoch,omitempty"`
}

// SendResult answers a send.
type SendResult struct {
	Output string `json:"output"`
	// OutputB64 is the output exactly (base64 in JSON) when it is not
	// valid UTF-8: Output then has U+FFFD for the bytes JSON text cannot
	// carry.
	OutputB64 []byte `json:"output_b64,omitempty"`
	// Ended says what ended the read: "until" (the output matched),
	// "idle" (quiet for idle_ms), "timeout" (timeout_ms passed: the
	// process may still be busy, and what it prints later comes with the
	// next send) or "exit" (the session's process exited; Exit is its
	// status, 128 + the signal of one killed).
	Ended string `json:"ended"`
	Exit  *int   `json:"exit,omitempty"`
	// ElapsedUS is the daemon's time of the send itself (writing the text
	// and reading the answer), without the restore and the turn.
	ElapsedUS int64 `json:"elapsed_us"`
	// Restore answers the request's Restore (nil without one); its
	// ElapsedUS is the daemon's time of the restore.
	Restore *RestoreResult `json:"restore,omitempty"`
	// Turn answers the request's Turn (nil without one); its ElapsedUS is
	// the daemon's time of the turn.
	Turn *TurnResult `json:"turn,omitempty"`
}

// TurnRequest is the body of POST /v1/sandboxes/{name}/turn (and of
// .../checkpoint, which forces mode full).
type TurnRequest struct {
	Mode  string `json:"mode,omitempty"`
	Wait  bool   `json:"wait,omitempty"`
	Epoch uint64 `json:"epoch,omitempty"`
	// Defer (auto mode) answers with a new checkpoint id at once and lets
	// the checkpoint close the probe window and decide (see
	// state.TurnRequest.Defer); the checkpoint's decision is known once
	// it is ready (GET /v1/checkpoints/{id}, or wait).
	Defer bool `json:"defer,omitempty"`
}

// TurnResult answers a turn. ElapsedUS is the daemon-side time of the call;
// the client replaces it by the time the caller saw.
type TurnResult struct {
	state.TurnResult
	ElapsedUS int64 `json:"elapsed_us"`
}

// RestoreRequest is the body of POST /v1/sandboxes/{name}/restore.
type RestoreRequest struct {
	Checkpoint string `json:"checkpoint"`
	Epoch      uint64 `json:"epoch,omitempty"`
}

// RestoreResult answers a restore.
type RestoreResult struct {
	state.RestoreResult
	ElapsedUS int64 `json:"elapsed_us"`
}

// Log answers GET /v1/sandboxes/{name}/log.
type Log struct {
	Sandbox     *state.Sandbox      `json:"sandbox"`
	Checkpoints []*state.Checkpoint `json:"checkpoints"`
	Pins        []string            `json:"pins,omitempty"`
}

// ForkRequest is the body of POST /v1/checkpoints/{id}/fork.
type ForkRequest struct {
	Count  int    `json:"count"`
	Prefix string `json:"prefix,omitempty"`
	NoWait bool   `json:"no_wait,omitempty"`
	// Prepare makes no sandboxes: the daemon prepares Count children in
	// the background, so that later forks of this checkpoint only name
	// them (see ForkResult.Prepared).
	Prepare bool `json:"prepare,omitempty"`
}

// ForkResult answers a fork.
type ForkResult struct {
	Sandboxes []string `json:"sandboxes"`
	ElapsedUS int64    `json:"elapsed_us"`
	// Prepared is, for a Prepare request, how many children the daemon
	// keeps ready (bounded by its --warm-forks).
	Prepared int `json:"prepared,omitempty"`
}

// PinRequest is the body of POST /v1/pins and POST /v1/unpin.
type PinRequest struct {
	IDs []string `json:"ids"`
}

// PinList answers pin calls and GET /v1/pins.
type PinList struct {
	Pins []string `json:"pins"`
}

// GCRequest is the body of POST /v1/gc.
type GCRequest struct {
	DryRun bool `json:"dry_run,omitempty"`
}
