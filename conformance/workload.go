// Package conformance runs workloads — file operations, shell commands,
// checkpoints, restores and forks described as data — on every path rewind
// offers (the FUSE overlay, the kernel path, ...) and on a reference model
// (a plain directory, fully copied at each checkpoint), and checks that every
// path reaches the same state at every checkpoint and restore.
//
// The workload format is documented in FORMAT.md next to this file; the
// shipped corpus lives in testdata/. Legitimate, documented differences of
// one path are encoded as narrow per-step exceptions (see Exceptions), never
// by weakening the state digest.
package conformance

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
)

// Workload is one conformance scenario.
type Workload struct {
	// Name identifies the workload in reports (default: the file name).
	Name string `json:"name"`
	// Description says what the workload exercises.
	Description string `json:"description,omitempty"`
	// AllowErrors lets operations fail as long as every path fails them
	// with the same errno (randomized workloads); otherwise an operation
	// fails the run unless its Error field names the expected errno.
	AllowErrors bool `json:"allow_errors,omitempty"`
	// Steps run in order.
	Steps []Step `json:"steps"`
}

// Step is one operation of a workload. Op selects the operation; the other
// fields are its arguments (FORMAT.md lists which op reads which field).
type Step struct {
	Op     string `json:"op"`
	Path   string `json:"path,omitempty"`
	To     string `json:"to,omitempty"`
	Target string `json:"target,omitempty"`
	Data   string `json:"data,omitempty"`
	// Repeat makes Data the concatenation of Repeat copies (large files).
	Repeat int    `json:"repeat,omitempty"`
	Mode   string `json:"mode,omitempty"` // octal, e.g. "0644"
	Offset int64  `json:"offset,omitempty"`
	// At is the offset of a positional fdwrite (pwrite); absent = write at
	// the descriptor's current offset.
	At    *int64 `json:"at,omitempty"`
	Size  int64  `json:"size,omitempty"`
	UID   *int   `json:"uid,omitempty"`
	GID   *int   `json:"gid,omitempty"`
	Name  string `json:"name,omitempty"`  // xattr name
	Value string `json:"value,omitempty"` // xattr value
	Kind  string `json:"kind,omitempty"`  // mknod: "fifo" | "char"
	Major uint32 `json:"major,omitempty"`
	Minor uint32 `json:"minor,omitempty"`
	FD    string `json:"fd,omitempty"`    // name of a held file descriptor
	Flags string `json:"flags,omitempty"` // open: r, w, rw, a, creat
	Cmd   string `json:"cmd,omitempty"`   // sh
	// Session names a process session (session, send); Argv starts it;
	// Marker is a command of the session's language printing its argument
	// "{m}" (e.g. "echo {m}", "print('{m}')"); State is a command printing
	// the session's state digest (cwd, chosen variables, a heap checksum).
	Session string   `json:"session,omitempty"`
	Argv    []string `json:"argv,omitempty"`
	Marker  string   `json:"marker,omitempty"`
	State   string   `json:"state,omitempty"`
	Label   string   `json:"label,omitempty"` // checkpoint / restore / fork
	View    string   `json:"view,omitempty"`  // fork / view
	// Expect is the content an fdread/expect step must see, or the
	// output an sh step must print (when ExpectSet).
	Expect *string `json:"expect,omitempty"`
	// Absent makes an expect step assert that Path does not exist.
	Absent bool `json:"absent,omitempty"`
	// Error is the errno name (e.g. "ENOTEMPTY") the step must fail with.
	Error string `json:"error,omitempty"`
	// Except maps a path name ("kernel", "fuse") to the name of a
	// documented exception that applies to this step on that path.
	Except map[string]string `json:"except,omitempty"`
	// Count and Steps describe a repeat block; "{i}" in any string field of
	// the inner steps is replaced by the iteration number (0-based).
	Count int    `json:"count,omitempty"`
	Steps []Step `json:"steps,omitempty"`
}

// Ops lists every operation the runner knows.
var Ops = []string{
	"write", "append", "truncate", "mkdir", "rm", "rmtree", "rename", "link", "symlink",
	"chmod", "chown", "setxattr", "rmxattr", "mknod", "sparse", "mmap",
	"open", "fdwrite", "fdread", "close", "sh", "session", "send",
	"checkpoint", "restore", "fork", "view", "compact", "turn", "compare", "expect", "repeat",
}

// Load reads a workload file.
func Load(file string) (*Workload, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("load workload: %w", err)
	}
	w, err := Parse(b)
	if err != nil {
		return nil, fmt.Errorf("workload %s: %w", file, err)
	}
	if w.Name == "" {
		w.Name = strings.TrimSuffix(path.Base(file), ".json")
	}
	return w, nil
}

// Parse decodes a workload (unknown fields are errors), expands repeat
// blocks and validates every step.
func Parse(b []byte) (*Workload, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var w Workload
	if err := dec.Decode(&w); err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	steps, err := expand(w.Steps, 0)
	if err != nil {
		return nil, err
	}
	w.Steps = steps
	if err := w.Validate(); err != nil {
		return nil, err
	}
	return &w, nil
}

// Marshal encodes a workload as indented JSON (one step per line).
func (w *Workload) Marshal() []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "{\n  \"name\": %s,\n", jsonString(w.Name))
	if w.Description != "" {
		fmt.Fprintf(&b, "  \"description\": %s,\n", jsonString(w.Description))
	}
	if w.AllowErrors {
		b.WriteString("  \"allow_errors\": true,\n")
	}
	b.WriteString("  \"steps\": [\n")
	for i, s := range w.Steps {
		line, _ := json.Marshal(s)
		b.WriteString("    ")
		b.Write(line)
		if i < len(w.Steps)-1 {
			b.WriteByte(',')
		}
		b.WriteByte('\n')
	}
	b.WriteString("  ]\n}\n")
	return b.Bytes()
}

func jsonString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

const maxSteps = 200000

func expand(in []Step, depth int) ([]Step, error) {
	if depth > 4 {
		return nil, fmt.Errorf("repeat blocks nested deeper than 4")
	}
	var out []Step
	for _, s := range in {
		if s.Op != "repeat" {
			out = append(out, s)
			continue
		}
		if s.Count <= 0 || len(s.Steps) == 0 {
			return nil, fmt.Errorf("repeat needs count > 0 and steps")
		}
		inner, err := expand(s.Steps, depth+1)
		if err != nil {
			return nil, err
		}
		for i := range s.Count {
			for _, is := range inner {
				out = append(out, is.subst(strconv.Itoa(i)))
			}
			if len(out) > maxSteps {
				return nil, fmt.Errorf("workload expands to more than %d steps", maxSteps)
			}
		}
	}
	return out, nil
}

func (s Step) subst(i string) Step {
	r := strings.NewReplacer("{i}", i)
	s.Path, s.To, s.Target = r.Replace(s.Path), r.Replace(s.To), r.Replace(s.Target)
	s.Data, s.Value, s.Name = r.Replace(s.Data), r.Replace(s.Value), r.Replace(s.Name)
	s.Cmd, s.Label, s.FD, s.View = r.Replace(s.Cmd), r.Replace(s.Label), r.Replace(s.FD), r.Replace(s.View)
	s.Session, s.State = r.Replace(s.Session), r.Replace(s.State)
	if s.Expect != nil {
		e := r.Replace(*s.Expect)
		s.Expect = &e
	}
	return s
}

// content is the data a write-like step writes.
func (s Step) content() []byte {
	if s.Repeat > 1 {
		return bytes.Repeat([]byte(s.Data), s.Repeat)
	}
	return []byte(s.Data)
}

// Process reports whether w drives processes (it starts a session): such
// workloads run on the process and probe paths; the others on the
// file-system paths.
func (w *Workload) Process() bool {
	for _, s := range w.Steps {
		if s.Op == "session" {
			return true
		}
	}
	return false
}

// Validate checks that every step is well-formed: known op, the fields it
// needs, relative paths that stay inside the tree, known exceptions, and
// restores of labels checkpointed before.
func (w *Workload) Validate() error {
	labels := map[string]bool{}
	for i, s := range w.Steps {
		if err := s.validate(labels); err != nil {
			return fmt.Errorf("step %d (%s): %w", i, s.Op, err)
		}
	}
	return nil
}

func (s Step) validate(labels map[string]bool) error {
	needPath := func(ps ...string) error {
		for _, p := range ps {
			if err := checkRel(p); err != nil {
				return err
			}
		}
		return nil
	}
	if s.Mode != "" {
		if _, err := strconv.ParseUint(s.Mode, 8, 32); err != nil {
			return fmt.Errorf("mode %q is not octal", s.Mode)
		}
	}
	for p, e := range s.Except {
		if _, ok := Exceptions[e]; !ok {
			return fmt.Errorf("unknown exception %q for path %s", e, p)
		}
		if !slices.Contains(Exceptions[e].Paths, p) {
			return fmt.Errorf("exception %q applies to %s, not %s", e, strings.Join(Exceptions[e].Paths, ", "), p)
		}
	}
	switch s.Op {
	case "write", "append", "mkdir", "rm", "rmtree", "sparse", "mmap":
		return needPath(s.Path)
	case "truncate":
		if s.Size < 0 {
			return fmt.Errorf("negative size")
		}
		return needPath(s.Path)
	case "rename", "link":
		return needPath(s.Path, s.To)
	case "symlink":
		if s.Target == "" {
			return fmt.Errorf("symlink needs target")
		}
		return needPath(s.Path)
	case "chmod":
		if s.Mode == "" {
			return fmt.Errorf("chmod needs mode")
		}
		return needPath(s.Path)
	case "chown":
		if s.UID == nil && s.GID == nil {
			return fmt.Errorf("chown needs uid or gid")
		}
		return needPath(s.Path)
	case "setxattr", "rmxattr":
		if s.Name == "" {
			return fmt.Errorf("%s needs name", s.Op)
		}
		return needPath(s.Path)
	case "mknod":
		if s.Kind != "fifo" && s.Kind != "char" {
			return fmt.Errorf("mknod kind must be fifo or char")
		}
		if s.Kind == "char" && s.Major == 0 && s.Minor == 0 {
			return fmt.Errorf("char 0:0 is a whiteout; not allowed")
		}
		return needPath(s.Path)
	case "open":
		if s.FD == "" {
			return fmt.Errorf("open needs fd")
		}
		switch s.Flags {
		case "", "r", "w", "rw", "a", "creat":
		default:
			return fmt.Errorf("unknown flags %q", s.Flags)
		}
		return needPath(s.Path)
	case "fdwrite", "fdread", "close":
		if s.FD == "" {
			return fmt.Errorf("%s needs fd", s.Op)
		}
		if s.Op == "fdread" && s.Expect == nil {
			return fmt.Errorf("fdread needs expect")
		}
	case "sh":
		if s.Cmd == "" {
			return fmt.Errorf("sh needs cmd")
		}
	case "checkpoint":
		if s.Label == "" {
			return fmt.Errorf("checkpoint needs label")
		}
		labels[s.Label] = true
	case "restore", "fork":
		if !labels[s.Label] {
			return fmt.Errorf("label %q was not checkpointed before", s.Label)
		}
		if s.Op == "fork" && s.View == "" {
			return fmt.Errorf("fork needs view")
		}
	case "view":
		if s.View == "" {
			return fmt.Errorf("view needs view")
		}
	case "session":
		if s.Session == "" || len(s.Argv) == 0 || !strings.Contains(s.Marker, "{m}") || s.State == "" {
			return fmt.Errorf("session needs session, argv, marker (with {m}) and state")
		}
	case "send":
		if s.Session == "" || s.Data == "" {
			return fmt.Errorf("send needs session and data")
		}
	case "turn":
		if s.Expect != nil {
			switch *s.Expect {
			case "skip", "fs", "full":
			default:
				return fmt.Errorf("turn expect must be skip, fs or full")
			}
		}
	case "compare", "compact":
	case "expect":
		if !s.Absent && s.Expect == nil {
			return fmt.Errorf("expect needs expect or absent")
		}
		return needPath(s.Path)
	default:
		return fmt.Errorf("unknown op (known: %s)", strings.Join(Ops, ", "))
	}
	return nil
}

// checkRel accepts a clean, relative, non-empty path that stays inside the
// tree.
func checkRel(p string) error {
	if p == "" {
		return fmt.Errorf("missing path")
	}
	if strings.HasPrefix(p, "/") || path.Clean(p) != p || p == "." || p == ".." || strings.HasPrefix(p, "../") {
		return fmt.Errorf("path %q must be clean, relative and inside the tree", p)
	}
	return nil
}
