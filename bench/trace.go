// Package bench replays agent tree-search trajectories and RL fan-out
// against rewind and against the state managers users would otherwise use,
// in one run on one machine, and reports the ratios.
//
// # Trace format
//
// A trace is JSON Lines. The first line is a header:
//
//	{"trace": "swe-1", "seed": 1, "setup": ["mkdir -p $R", ...]}
//
// and every further line is one node of the search tree, in expansion order:
//
//	{"id": 7, "parent": 3, "kind": "edit", "commands": ["sed -i ... $R/src/x.py"], "llm_ms": 1840}
//
// id counts from 1; parent 0 is the root (the state right after setup). A
// node whose parent is not the node expanded just before it is a rollback:
// the harness restores the parent's checkpoint before running the node.
// commands run, in order, in one persistent bash whose $R names the
// repository root; llm_ms is the simulated LLM latency the agent waited
// before the node (accounted, never slept). kind is informational: read,
// edit, test, install, cd, env, server, kill.
package bench

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
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

// ReadTrace reads and validates a JSON Lines trace.
func ReadTrace(r io.Reader) (*Trace, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	var t Trace
	line := 0
	seen := map[int]bool{0: true}
	for sc.Scan() {
		line++
		b := sc.Bytes()
		if len(b) == 0 {
			continue
		}
		if line == 1 {
			if err := json.Unmarshal(b, &t); err != nil {
				return nil, fmt.Errorf("trace header (line 1): %w", err)
			}
			continue
		}
		var n Node
		if err := json.Unmarshal(b, &n); err != nil {
			return nil, fmt.Errorf("trace line %d: %w", line, err)
		}
		switch {
		case n.ID <= 0 || seen[n.ID]:
			return nil, fmt.Errorf("trace line %d: id %d is not a new positive id", line, n.ID)
		case !seen[n.Parent]:
			return nil, fmt.Errorf("trace line %d: node %d names parent %d, which is not an earlier node", line, n.ID, n.Parent)
		case n.LLMMS < 0:
			return nil, fmt.Errorf("trace line %d: negative llm_ms", line)
		}
		seen[n.ID] = true
		t.Nodes = append(t.Nodes, n)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read trace: %w", err)
	}
	if line == 0 {
		return nil, fmt.Errorf("read trace: empty")
	}
	return &t, nil
}
