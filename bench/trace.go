// Package bench replays agent tree-search trajectories and RL fan-out
// against rewind and against the state managers users would otherwise use,
// in one run on one machine, and reports the ratios.
//
// # Trace format
//
// A trace is JSON Lines. Its first line is a header:
//
//	{"trace": "swe-1", "seed": 1, "setup": ["mkdir -p $R", ...]}
//
// and every further line is one node of the search tree, in expansion order:
//
//	{"id": 7, "parent": 3, "kind": "edit", "commands": ["sed -i ... $R/src/x.py"], "llm_ms": 1840}
//
// In the header, trace (the name) is required and not empty; seed (the
// crash checks' turns are drawn from it; default 0) and setup (commands
// run before the root, each not blank) are optional. In a node, id, parent
// and commands are required: id counts from 1 and is new in the trace;
// parent is 0 (the root: the state right after setup) or an earlier node's
// id; commands is a non-empty list of non-blank commands. A node whose
// parent is not the node expanded just before it is a rollback: the
// harness restores the parent's checkpoint before running the node.
// commands run, in order, in one persistent bash whose $R names the
// repository root; llm_ms (default 0, at most MaxLLMMS: one hour) is the
// simulated LLM latency the agent waited before the node (accounted, never
// slept). kind is informational (the generator's kinds are read, edit,
// test, install, cd, env, server, kill): nothing depends on it.
//
// A field a line's kind of object does not have is an error (a misspelt
// llm_ms is not taken for 0), so are a line that is not one JSON object,
// and a line longer than 16 MiB. Blank lines are skipped; line numbers in
// errors count every line. A file may hold several traces one after the
// other, each starting with its header line, each with at least one node
// (ReadTraces); that is what Trace.Write of each trace into one file makes.
//
// # What the crash check expects of the shell
//
// A crash check (ReplayOptions.CrashChecks) compares the state a recovery
// brings back with the state a run without a crash would have: the files
// under $R and the number of background jobs as the live sandbox has them,
// and the shell's cwd and $AGENT_STEP as the trace's commands set them.
// Those two come from a model of the commands, the same for every kind of
// node, applied to the setup and then along the tree to each node:
//
//   - Each command is cut into top-level pieces at the control operators
//     ;, &, newline, &&, || and | (outside quotes, parentheses, command
//     substitutions and comments; the & of a redirection such as 2>&1 is
//     not one).
//   - Left out, as not run by the shell itself: a list that ends with &
//     (background: all of "a && b &" runs in a subshell), a member of a
//     pipeline (a | b), a subshell ( ... ), and a piece right after ||
//     (the model assumes every command succeeds, so what follows || does
//     not run).
//   - Of the rest, exactly these simple commands change the model, with
//     any trailing redirections (cd - >/dev/null): "cd $R" or "cd $R/PATH"
//     ($R or ${R}, optionally in double quotes; PATH without $, quotes,
//     backslashes or glob characters, and not climbing above $R) sets the
//     cwd to PATH, normalized as bash does, remembering the old one;
//     "cd -" swaps the two (and does nothing before a cd); "export
//     AGENT_STEP=V", "AGENT_STEP=V" alone and "unset AGENT_STEP" set or
//     clear the step (V unquoted, or quoted whole, without $, ` or \).
//
// Anything else leaves the model as it was: a trace that changes the cwd
// another way (cd src, cd .., pushd, a cd inside { }, if or a loop, or a
// cd that fails) makes every system fail the checks after it.
package bench

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
)

// Node is one expansion of the search tree.
type Node struct {
	ID       int      `json:"id"`
	Parent   int      `json:"parent"`
	Kind     string   `json:"kind"`
	Commands []string `json:"commands"`
	LLMMS    float64  `json:"llm_ms"`
}

// Trace is a search trajectory: setup commands, then nodes in expansion order.
type Trace struct {
	Name  string   `json:"trace"`
	Seed  int64    `json:"seed,omitempty"`
	Setup []string `json:"setup"`
	Nodes []Node   `json:"-"`
}

// Rollbacks counts the nodes whose parent is not the previous node.
func (t *Trace) Rollbacks() int {
	n, prev := 0, 0
	for _, nd := range t.Nodes {
		if nd.Parent != prev {
			n++
		}
		prev = nd.ID
	}
	return n
}

// Write writes t as JSON Lines.
func (t *Trace) Write(w io.Writer) error {
	enc := json.NewEncoder(w)
	if err := enc.Encode(t); err != nil {
		return fmt.Errorf("write trace %s: %w", t.Name, err)
	}
	for _, n := range t.Nodes {
		if err := enc.Encode(n); err != nil {
			return fmt.Errorf("write trace %s node %d: %w", t.Name, n.ID, err)
		}
	}
	return nil
}

// MaxLLMMS bounds a node's llm_ms: one hour. A model that takes longer is
// not a tree search's step, and sums of such values lose the other times'
// precision.
const MaxLLMMS = 3600 * 1000

// maxLine bounds a trace line (the longest commands one node carries).
const maxLine = 16 << 20

// traceHeader is a header line as read: every field a header may have.
type traceHeader struct {
	Name  *string  `json:"trace"`
	Seed  int64    `json:"seed"`
	Setup []string `json:"setup"`
}

// nodeLine is a node line as read: every field a node may have, the
// required ones as pointers to tell a missing one from a zero.
type nodeLine struct {
	ID       *int      `json:"id"`
	Parent   *int      `json:"parent"`
	Kind     string    `json:"kind"`
	Commands *[]string `json:"commands"`
	LLMMS    float64   `json:"llm_ms"`
}

// ReadTraces reads and validates one or more JSON Lines traces, one after
// the other in r, each starting with its header (see the package
// comment).
func ReadTraces(r io.Reader) ([]*Trace, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), maxLine)
	var out []*Trace
	var t *Trace
	var seen map[int]bool
	line := 0
	done := func() error {
		if t != nil && len(t.Nodes) == 0 {
			return fmt.Errorf("trace %q has no nodes", t.Name)
		}
		return nil
	}
	for sc.Scan() {
		line++
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		var keys map[string]json.RawMessage
		if err := json.Unmarshal(b, &keys); err != nil {
			return nil, fmt.Errorf("trace line %d: not a JSON object: %w", line, err)
		}
		if _, ok := keys["trace"]; ok {
			if err := done(); err != nil {
				return nil, fmt.Errorf("trace line %d: a new header: %w", line, err)
			}
			h, err := readHeader(b)
			if err != nil {
				return nil, fmt.Errorf("trace line %d: header: %w", line, err)
			}
			t, seen = h, map[int]bool{0: true}
			out = append(out, t)
			continue
		}
		if t == nil {
			return nil, fmt.Errorf("trace line %d: the first line must be the header {\"trace\": NAME, \"seed\": N, \"setup\": [...]}, not a node", line)
		}
		n, err := readNode(b, seen)
		if err != nil {
			return nil, fmt.Errorf("trace line %d: %w", line, err)
		}
		seen[n.ID] = true
		t.Nodes = append(t.Nodes, n)
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return nil, fmt.Errorf("trace line %d: longer than %d MiB", line+1, maxLine>>20)
		}
		return nil, fmt.Errorf("read trace: %w", err)
	}
	if len(out) == 0 {
		return nil, errors.New("read trace: empty (no header line)")
	}
	if err := done(); err != nil {
		return nil, fmt.Errorf("read trace: %w", err)
	}
	return out, nil
}

// strictDecode decodes one JSON object (ReadTraces checked it is one) into
// v, refusing fields v lacks, with what (which fields there are) in the
// error.
func strictDecode(b []byte, v any, what string) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		if f, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
			return fmt.Errorf("unknown field %s (%s)", f, what)
		}
		return err
	}
	return nil
}

func readHeader(b []byte) (*Trace, error) {
	var h traceHeader
	if err := strictDecode(b, &h, "a header has trace, seed, setup"); err != nil {
		return nil, err
	}
	if h.Name == nil || *h.Name == "" {
		return nil, errors.New("trace (the name) is empty")
	}
	for i, c := range h.Setup {
		if strings.TrimSpace(c) == "" {
			return nil, fmt.Errorf("setup command %d is blank", i+1)
		}
	}
	return &Trace{Name: *h.Name, Seed: h.Seed, Setup: h.Setup}, nil
}

func readNode(b []byte, seen map[int]bool) (Node, error) {
	var l nodeLine
	if err := strictDecode(b, &l, "a node has id, parent, kind, commands, llm_ms"); err != nil {
		return Node{}, err
	}
	missing := []string{}
	for name, ok := range map[string]bool{"id": l.ID != nil, "parent": l.Parent != nil, "commands": l.Commands != nil && *l.Commands != nil} {
		if !ok {
			missing = append(missing, name)
		}
	}
	if len(missing) > 0 {
		sort.Strings(missing)
		return Node{}, fmt.Errorf("missing %s (parent 0 is the root)", strings.Join(missing, ", "))
	}
	n := Node{ID: *l.ID, Parent: *l.Parent, Kind: l.Kind, Commands: *l.Commands, LLMMS: l.LLMMS}
	switch {
	case n.ID <= 0 || seen[n.ID]:
		return n, fmt.Errorf("id %d is not a new positive id", n.ID)
	case !seen[n.Parent]:
		return n, fmt.Errorf("node %d names parent %d, which is not an earlier node", n.ID, n.Parent)
	case n.LLMMS < 0:
		return n, fmt.Errorf("node %d: negative llm_ms", n.ID)
	case n.LLMMS > MaxLLMMS:
		return n, fmt.Errorf("node %d: llm_ms %g is over %d (one hour)", n.ID, n.LLMMS, MaxLLMMS)
	case len(n.Commands) == 0:
		return n, fmt.Errorf("node %d: commands is empty", n.ID)
	}
	for i, c := range n.Commands {
		if strings.TrimSpace(c) == "" {
			return n, fmt.Errorf("node %d: command %d is blank", n.ID, i+1)
		}
	}
	return n, nil
}
