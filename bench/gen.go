package bench

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
)

// GenOptions shapes a generated trace.
type GenOptions struct {
	// Expansions is the number of nodes (default 100).
	Expansions int
	// Rollbacks is the target number of rollbacks (default Expansions/2).
	Rollbacks int
	// MedianLLMMS is the median simulated LLM latency (default 2000 ms);
	// latencies are log-normal with sigma 0.5. Zero keeps the default; use
	// ZeroLLM for a pure state-management measurement.
	MedianLLMMS float64
	// ZeroLLM sets every llm_ms to 0.
	ZeroLLM bool
	// Exclude lists action kinds not to generate (e.g. "server", "kill"):
	// each a known kind (Kinds), once; at least one kind must remain.
	Exclude []string
}

// Kinds returns the kinds of action Generate makes, in a fixed order.
func Kinds() []string {
	out := make([]string, len(kinds))
	for i, k := range kinds {
		out[i] = k.kind
	}
	return out
}

// check refuses options Generate cannot follow.
func (o GenOptions) check() error {
	switch {
	case o.Expansions < 0:
		return fmt.Errorf("%d expansions: want 1 or more (0: the default)", o.Expansions)
	case o.Rollbacks < 0:
		return fmt.Errorf("%d rollbacks: want 0 or more", o.Rollbacks)
	case o.MedianLLMMS < 0 || o.MedianLLMMS > MaxLLMMS || math.IsNaN(o.MedianLLMMS):
		return fmt.Errorf("median LLM latency %g ms: want 0..%d", o.MedianLLMMS, MaxLLMMS)
	}
	seen := map[string]bool{}
	for _, k := range o.Exclude {
		switch {
		case !slices.Contains(Kinds(), k):
			return fmt.Errorf("unknown kind %q to exclude (kinds: %s)", k, strings.Join(Kinds(), ", "))
		case seen[k]:
			return fmt.Errorf("kind %q excluded twice", k)
		}
		seen[k] = true
	}
	if len(seen) == len(kinds) {
		return fmt.Errorf("every kind excluded (%s): at least one must remain", strings.Join(Kinds(), ", "))
	}
	return nil
}

// kinds of actions with their weights: read-only actions are the majority,
// as in published agent traces.
var kinds = []struct {
	kind   string
	weight int
}{
	{"read", 58}, {"edit", 14}, {"test", 9}, {"cd", 6}, {"env", 4},
	{"install", 4}, {"server", 3}, {"kill", 2},
}

// Generate makes a realistic SWE-style tree-search trace from a seed: the
// agent reads and greps a small Python repository, edits it, runs its tests,
// installs packages into a venv-like tree, starts and stops a background
// server, changes directory and variables in its persistent shell. It refuses
// unknown or duplicate kinds to exclude, excluding every kind, and negative
// counts.
func Generate(seed int64, o GenOptions) (*Trace, error) {
	if err := o.check(); err != nil {
		return nil, fmt.Errorf("generate trace: %w", err)
	}
	if o.Expansions == 0 {
		o.Expansions = 100
	}
	if o.Rollbacks == 0 {
		o.Rollbacks = o.Expansions / 2
	}
	if o.MedianLLMMS == 0 {
		o.MedianLLMMS = 2000
	}
	rng := rand.New(rand.NewPCG(uint64(seed), 0x72657769))
	t := &Trace{Name: fmt.Sprintf("swe-%d", seed), Seed: seed, Setup: setupCommands()}
	if len(o.Exclude) > 0 {
		t.Name += "-no-" + strings.Join(o.Exclude, "-")
	}
	ks := kinds[:0:0]
	for _, k := range kinds {
		if !slices.Contains(o.Exclude, k.kind) {
			ks = append(ks, k)
		}
	}
	total := 0
	for _, k := range ks {
		total += k.weight
	}
	pRollback := float64(o.Rollbacks) / float64(o.Expansions)
	prev := 0
	for id := 1; id <= o.Expansions; id++ {
		parent := prev
		if id > 1 && rng.Float64() < pRollback {
			// Reselect an earlier node (UCT may pick any expanded node).
			for parent == prev {
				parent = rng.IntN(id) // 0..id-1
			}
		}
		w := rng.IntN(total)
		kind := ks[0].kind
		for _, k := range ks {
			if w < k.weight {
				kind = k.kind
				break
			}
			w -= k.weight
		}
		llm := 0.0
		if !o.ZeroLLM {
			// Within what ReadTraces accepts (a median near the bound).
			llm = min(math.Round(o.MedianLLMMS*math.Exp(0.5*rng.NormFloat64())), MaxLLMMS)
		}
		t.Nodes = append(t.Nodes, Node{ID: id, Parent: parent, Kind: kind, Commands: commandsFor(kind, id, rng), LLMMS: llm})
		prev = id
	}
	return t, nil
}

// setupCommands create the repository the agent works on under $R.
func setupCommands() []string {
	return []string{
		`mkdir -p $R/src/app $R/tests $R/docs $R/.venv/lib/site-packages`,
		`cd $R && for i in $(seq 1 40); do printf 'def f%d(x):\n    # TODO: handle edge case %d\n    return x + %d\n' $i $i $i > src/app/mod$i.py; done`,
		`cd $R && printf 'import unittest\nfrom app import mod1\nclass T(unittest.TestCase):\n    def test_f1(self):\n        self.assertEqual(mod1.f1(1), 2)\n' > tests/test_mod1.py && touch src/app/__init__.py`,
		`cd $R && for i in $(seq 1 20); do head -c 2048 /dev/zero | tr '\0' 'x' > docs/page$i.md; done && echo '# demo repo' > README.md`,
		`cd $R`,
	}
}

// commandsFor returns the commands of one action; they use absolute paths
// under $R where the cwd would otherwise matter.
func commandsFor(kind string, id int, rng *rand.Rand) []string {
	m := rng.IntN(40) + 1
	switch kind {
	case "read":
		return []string{[]string{
			fmt.Sprintf("cat $R/src/app/mod%d.py", m),
			"grep -rn TODO $R/src | head -20",
			"ls -la $R $R/src/app | head -40",
			"find $R -name '*.py' | wc -l",
			fmt.Sprintf("head -n 3 $R/src/app/mod%d.py; wc -l $R/src/app/*.py | tail -1", m),
			"grep -rln 'return x' $R/src | wc -l",
		}[rng.IntN(6)]}
	case "edit":
		return []string{fmt.Sprintf("sed -i 's/return x + %d$/return x + %d  # edited by node %d/' $R/src/app/mod%d.py", m, m, id, m)}
	case "test":
		return []string{"cd $R && PYTHONPATH=src python3 -m unittest -q 2>&1 | tail -1; cd - >/dev/null"}
	case "cd":
		return []string{[]string{"cd $R/src/app", "cd $R/tests", "cd $R"}[rng.IntN(3)]}
	case "env":
		return []string{fmt.Sprintf("export AGENT_STEP=%d", id)}
	case "install":
		// A pip-like burst: a package of a few hundred small files.
		return []string{fmt.Sprintf(`python3 -c "
import os
d = os.path.expandvars('$R/.venv/lib/site-packages/pkg%d')
os.makedirs(d, exist_ok=True)
for i in range(200):
    open(os.path.join(d, 'm%%d.py' %% i), 'w').write('X = %%d\n' %% i)
open(d + '.dist-info', 'w').write('Name: pkg%d\n')
"`, id, id)}
	case "server":
		port := 20000 + id
		return []string{fmt.Sprintf("(cd $R/docs && exec python3 -m http.server %d --bind 127.0.0.1 >/dev/null 2>&1) &", port)}
	case "kill":
		return []string{"kill %1 2>/dev/null; wait 2>/dev/null; true"}
	}
	return []string{"true"}
}
