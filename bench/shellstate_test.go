package bench

import (
	"reflect"
	"strings"
	"testing"
)

// oldNext is the model the crash check used before it became
// kind-independent: cd only in "cd" nodes, export only in "env" nodes.
func oldNext(s shellState, n Node) shellState {
	for _, c := range n.Commands {
		switch {
		case n.Kind == "cd" && strings.HasPrefix(c, "cd $R"):
			s.cwd = strings.TrimPrefix(c, "cd $R")
		case n.Kind == "env" && strings.HasPrefix(c, "export AGENT_STEP="):
			s.step = strings.TrimPrefix(c, "export AGENT_STEP=")
		}
	}
	return s
}

// TestShellModelKeepsGeneratedStates: on generated traces (every kind,
// with its rollbacks) the kind-independent model expects, node by node,
// the cwd and step the old kind-based one did, from the setup's state on.
func TestShellModelKeepsGeneratedStates(t *testing.T) {
	for seed := int64(1); seed <= 20; seed++ {
		tr := mustGenerate(t, seed, GenOptions{})
		root := shellState{}.run(tr.Setup)
		if root.suffix() != (shellState{}).suffix() {
			t.Fatalf("seed %d: after setup %+v, want $R and no step", seed, root)
		}
		oldS, newS := map[int]shellState{0: {}}, map[int]shellState{0: root}
		for _, n := range tr.Nodes {
			oldS[n.ID], newS[n.ID] = oldNext(oldS[n.Parent], n), newS[n.Parent].next(n)
			if o, g := oldS[n.ID].suffix(), newS[n.ID].suffix(); o != g {
				t.Fatalf("seed %d node %d (%s %q): expected%s, was%s", seed, n.ID, n.Kind, n.Commands, g, o)
			}
		}
	}
}

// TestShellModel: what each command does to the expected cwd and step,
// whatever the node's kind, from a shell in $R/a whose old cwd is $R/b
// and whose step is 1.
func TestShellModel(t *testing.T) {
	tests := []struct {
		name, cmd string
		cwd, old  string
		step      string
	}{
		{"cd", "cd $R/src", "/src", "/a", "1"},
		{"cd root", "cd $R", "", "/a", "1"},
		{"cd braces and quotes", `cd "${R}/src/app/"`, "/src/app", "/a", "1"},
		{"cd normalized", "cd $R/src/./x/../app//", "/src/app", "/a", "1"},
		{"cd above R", "cd $R/..", "/a", "/b", "1"},
		{"cd relative", "cd src", "/a", "/b", "1"},
		{"cd other variable", "cd $RX/src", "/a", "/b", "1"},
		{"cd with redirections", "cd $R/src >/dev/null 2>&1", "/src", "/a", "1"},
		{"cd with a spaced redirection", "cd $R/src > /dev/null", "/src", "/a", "1"},
		{"cd with more arguments", "cd $R/src x", "/a", "/b", "1"},
		{"cd -", "cd -", "/b", "/a", "1"},
		{"cd - quiet", "cd - >/dev/null", "/b", "/a", "1"},
		{"test kind", "cd $R && PYTHONPATH=src python3 -m unittest -q 2>&1 | tail -1; cd - >/dev/null", "/a", "", "1"},
		{"server kind", "(cd $R/docs && exec python3 -m http.server 20001 --bind 127.0.0.1 >/dev/null 2>&1) &", "/a", "/b", "1"},
		{"background list", "cd $R/src && sleep 1 &", "/a", "/b", "1"},
		{"background then foreground", "sleep 1 & cd $R/src", "/src", "/a", "1"},
		{"pipeline member", "cd $R/src | cat", "/a", "/b", "1"},
		{"after ||", "true || cd $R/src", "/a", "/b", "1"},
		{"after || then &&", "true || false && cd $R/src", "/src", "/a", "1"},
		{"after &&", "true && cd $R/src", "/src", "/a", "1"},
		{"subshell", "(cd $R/src)", "/a", "/b", "1"},
		{"command substitution", "x=$(cd $R/src; pwd)", "/a", "/b", "1"},
		{"quoted operators", `echo 'a; cd $R/src' "&& cd $R/tests"`, "/a", "/b", "1"},
		{"comment", "true # ; cd $R/src", "/a", "/b", "1"},
		{"cd then a comment", "cd $R/src # there", "/src", "/a", "1"},
		{"newline", "true\ncd $R/src", "/src", "/a", "1"},
		{"in a group", "{ cd $R/src; }", "/a", "/b", "1"},
		{"redirection ampersands", "ls &>/dev/null; cd $R/src 2>&1", "/src", "/a", "1"},
		{"export", "export AGENT_STEP=7", "/a", "/b", "7"},
		{"export quoted", `export AGENT_STEP="7"`, "/a", "/b", "7"},
		{"export among others", "export A=1 AGENT_STEP=8", "/a", "/b", "8"},
		{"export expanded", "export AGENT_STEP=$X", "/a", "/b", "1"},
		{"assignment alone", "AGENT_STEP=9", "/a", "/b", "9"},
		{"assignment for one command", "AGENT_STEP=9 env", "/a", "/b", "1"},
		{"unset", "unset AGENT_STEP", "/a", "/b", ""},
		{"export in a subshell", "(export AGENT_STEP=3)", "/a", "/b", "1"},
		{"cd and export in one line", "cd $R/tests; export AGENT_STEP=4", "/tests", "/a", "4"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			start := shellState{cwd: "/a", old: "/b", oldSet: true, step: "1"}
			got := start.run([]string{tc.cmd})
			want := shellState{cwd: tc.cwd, old: tc.old, oldSet: true, step: tc.step}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("%q: %+v, want %+v", tc.cmd, got, want)
			}
		})
	}
	// cd - before any cd: bash has no OLDPWD and stays.
	if got := (shellState{cwd: "/a"}).run([]string{"cd -"}); got.cwd != "/a" {
		t.Errorf("cd - without an old cwd: %+v", got)
	}
	// The tester's hand trace: a node of kind env that changes the cwd.
	n := Node{Kind: "env", Commands: []string{"cd $R/src"}}
	if got := (shellState{}).next(n); got.cwd != "/src" {
		t.Errorf("kind env, cd $R/src: %+v", got)
	}
}

// TestShellPieces: how a command line is cut and which pieces the shell
// runs itself.
func TestShellPieces(t *testing.T) {
	tests := []struct {
		line string
		want []string
	}{
		{"a && b || c; d & e | f\ng", []string{"a", "b", "g"}},
		{"a; b ;; c", []string{"a", "b", "c"}},
		{`a "x; y" 'p && q' \; b`, []string{`a "x; y" 'p && q' \; b`}},
		{`echo "$(cd "$R" && ls)"; b`, []string{`echo "$(cd "$R" && ls)"`, "b"}},
		{"echo `a; b`; c", []string{"echo `a; b`", "c"}},
		{"x=$((1+2)); y", []string{"x=$((1+2))", "y"}},
		{"a >| f; b |& c", []string{"a >| f"}},
		{"a # x; y\nb", []string{"a # x; y", "b"}},
		{"echo a#b; c", []string{"echo a#b", "c"}},
		{"  ", nil},
		{"unterminated 'quote; b", []string{"unterminated 'quote; b"}},
	}
	for _, tc := range tests {
		if got := shellPieces(tc.line); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%q: %q, want %q", tc.line, got, tc.want)
		}
	}
}
