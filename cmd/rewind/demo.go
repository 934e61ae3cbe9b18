package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/client"
	"github.com/rewind-sandbox/rewind/state"
)

func newDemoCmd() *cobra.Command {
	var o clientOpts
	var keep bool
	var forks int
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run a scripted coding-agent trajectory with a turn after every step, restores and a fork",
		Long: `demo plays a realistic coding-agent trajectory in a sandbox built on the host's root file
system (read-only) and calls turn after every step: it creates a small Python project, reads and
greps it, edits files, creates a venv and installs the project into it, runs its tests, starts a
background HTTP server and changes directory, variables and functions in a persistent bash. Then
it restores earlier checkpoints (checking files, the shell's state and the server) and forks
rollouts from the last one. It prints a row per turn and a summary. Needs root, python3 and
python3-venv; it starts a daemon if none runs.`,
		Example: "  rewind demo\n  rewind demo --forks 8 --keep",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := o.connect(cmd)
			if err != nil {
				return err
			}
			d := &demo{c: c, ctx: cmd.Context(), out: cmd.OutOrStdout(), name: fmt.Sprintf("demo-%d", os.Getpid())}
			err = d.run(forks)
			if !keep {
				d.cleanup()
			}
			return err
		},
	}
	cmd.Flags().BoolVar(&keep, "keep", false, "keep the demo's sandboxes afterwards")
	cmd.Flags().IntVar(&forks, "forks", 8, "rollouts to fork at the end")
	o.add(cmd)
	return cmd
}

type demo struct {
	c     *client.Client
	ctx   context.Context
	out   io.Writer
	name  string
	forks []string
	rows  []demoRow
	fail  []string
	n     int
}

type demoRow struct {
	step, what        string
	decision, reason  string
	id                string
	callUS            int64
	frozenUS, tookUS  int64
	restoreUS         int64
	restorePath, note string
}

const demoProject = `mkdir -p /work/proj/calc && cd /work/proj &&
cat > calc/__init__.py <<'EOF'
def add(a, b):
    return a - b  # bug: the agent will fix this


def mul(a, b):
    return a * b
EOF
cat > test_calc.py <<'EOF'
import unittest
from calc import add, mul


class TestCalc(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_mul(self):
        self.assertEqual(mul(2, 3), 6)


if __name__ == "__main__":
    unittest.main()
EOF
cat > setup.py <<'EOF'
from setuptools import setup

setup(name="calc", version="0.1.0", packages=["calc"])
EOF
echo "# calc" > README.md`

const demoMarker = "@@rewind-demo@@"

func (d *demo) sh(script string) (string, error) {
	var out bytes.Buffer
	code, err := d.c.Exec(d.ctx, d.name, api.ExecRequest{Argv: []string{"sh", "-c", script}, Dir: "/"}, &out, &out)
	if err != nil {
		return out.String(), err
	}
	if code != 0 {
		return out.String(), fmt.Errorf("exit status %d: %s", code, strings.TrimSpace(lastN(out.String(), 400)))
	}
	return out.String(), nil
}

func (d *demo) bash(line string) (string, error) {
	out, err := d.c.Send(d.ctx, d.name, "sh", api.SendRequest{Text: line + "; echo " + demoMarker, Until: demoMarker, TimeoutMS: 120000})
	return strings.TrimSpace(strings.ReplaceAll(out, demoMarker, "")), err
}

func lastN(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// waitReady polls a checkpoint until it is no longer pending.
func (d *demo) waitReady(id string) (*state.Checkpoint, error) {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		ck, err := d.c.GetCheckpoint(d.ctx, id)
		if err != nil || ck.Status != state.CkptPending || time.Now().After(deadline) {
			return ck, err
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// step runs one agent action, then a turn, and prints the row.
func (d *demo) step(what string, act func() (string, error)) (*api.TurnResult, error) {
	d.n++
	fmt.Fprintf(d.out, "[%2d] %-52s ", d.n, what)
	if _, err := act(); err != nil {
		fmt.Fprintln(d.out, "FAILED")
		return nil, fmt.Errorf("step %d (%s): %w", d.n, what, err)
	}
	t, err := d.c.Turn(d.ctx, d.name, api.TurnRequest{})
	if err != nil {
		fmt.Fprintln(d.out, "FAILED")
		return nil, fmt.Errorf("turn after step %d: %w", d.n, err)
	}
	row := demoRow{step: fmt.Sprint(d.n), what: what, decision: string(t.Decision), reason: t.Reason, id: t.ID, callUS: t.ElapsedUS}
	if t.Decision != state.ModeSkip {
		ck, err := d.waitReady(t.ID)
		if err == nil {
			row.frozenUS, row.tookUS = ck.FrozenUS, ck.TookUS
			if ck.Status == state.CkptFailed {
				row.note = "checkpoint failed: " + ck.Error
				d.fail = append(d.fail, fmt.Sprintf("step %d: %s", d.n, row.note))
			}
		}
	}
	d.rows = append(d.rows, row)
	fmt.Fprintf(d.out, "%-4s %-15s turn %6.2f ms  frozen %6.2f ms  checkpoint %7.2f ms  (%s)\n",
		row.decision, row.id, ms1(row.callUS), ms1(row.frozenUS), ms1(row.tookUS), row.reason)
	if row.note != "" {
		fmt.Fprintf(d.out, "     ! %s\n", row.note)
	}
	return t, nil
}

func ms1(us int64) float64 { return float64(us) / 1000 }

func (d *demo) restore(label, id string) error {
	fmt.Fprintf(d.out, "[restore] %-45s ", label+" ("+id+")")
	r, err := d.c.Restore(d.ctx, d.name, id, 0)
	if err != nil {
		fmt.Fprintln(d.out, "FAILED")
		return fmt.Errorf("restore %s: %w", id, err)
	}
	fmt.Fprintf(d.out, "via %-9s %7.2f ms (epoch %d)\n", r.Path, ms1(r.ElapsedUS), r.Epoch)
	d.rows = append(d.rows, demoRow{step: "R", what: label, id: id, restoreUS: r.ElapsedUS, restorePath: r.Path})
	return nil
}

func (d *demo) check(what string, got, want string) {
	ok := strings.TrimSpace(got) == want
	mark := "ok"
	if !ok {
		g := strings.TrimSpace(got)
		if lines := strings.Split(g, "\n"); len(lines) > 3 {
			g = "... " + strings.Join(lines[len(lines)-2:], "\n")
		}
		mark = fmt.Sprintf("MISMATCH: got %q, want %q", g, want)
		d.fail = append(d.fail, what+": "+mark)
	}
	fmt.Fprintf(d.out, "          check %-42s %s\n", what, mark)
}

func (d *demo) run(forks int) error {
	start := time.Now()
	v, err := d.c.Version(d.ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(d.out, "rewind demo: sandbox %s on the host's root (read-only), back ends %v\n\n", d.name, v.Backends)
	if _, err := d.c.Create(d.ctx, api.CreateRequest{Name: d.name}); err != nil {
		return err
	}
	if _, err := d.c.StartSession(d.ctx, d.name, api.SessionRequest{ID: "sh", Argv: []string{"bash", "--norc", "--noprofile"}}); err != nil {
		return err
	}
	steps := []struct {
		what string
		act  func() (string, error)
	}{
		{"bash: cd /work (persistent shell)", func() (string, error) { return d.bash("mkdir -p /work && cd /work") }},
		{"write a small Python project", func() (string, error) { return d.sh(demoProject) }},
		{"ls -la /work/proj", func() (string, error) { return d.sh("ls -la /work/proj") }},
		{"cat calc/__init__.py", func() (string, error) { return d.sh("cat /work/proj/calc/__init__.py") }},
		{"grep -rn 'def ' /work/proj", func() (string, error) { return d.sh("grep -rn 'def ' /work/proj") }},
		{"fix the bug (sed -i)", func() (string, error) {
			return d.sh("sed -i 's/return a - b.*/return a + b/' /work/proj/calc/__init__.py")
		}},
		{"python3 -m venv /work/venv", func() (string, error) { return d.sh("python3 -m venv /work/venv") }},
		{"install the project into the venv (offline)", func() (string, error) {
			return d.sh("cd /work/proj && /work/venv/bin/python setup.py -q install 2>&1 && rm -rf build *.egg-info")
		}},
		{"run the tests", func() (string, error) {
			return d.sh("cd /tmp && /work/venv/bin/python -m unittest -q /work/proj/test_calc.py 2>&1 || (cd /work/proj && /work/venv/bin/python -m unittest -q 2>&1)")
		}},
		{"start a background HTTP server", func() (string, error) {
			return d.sh(`cd /work/proj && (setsid nohup python3 -m http.server 8000 --bind 127.0.0.1 >/tmp/server.log 2>&1 < /dev/null & echo $! > /tmp/server.pid)
for i in $(seq 100); do python3 -c "import socket; socket.create_connection(('127.0.0.1', 8000), 1)" 2>/dev/null && exit 0; sleep 0.1; done; exit 1`)
		}},
		{"query the server", func() (string, error) {
			return d.sh(`python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/README.md', timeout=5).read().decode())"`)
		}},
		{"bash: cd, export, define a function", func() (string, error) {
			return d.bash(`cd /work/proj && export APP_ENV=dev && greet() { echo "hello $1"; }`)
		}},
		{"edit README.md", func() (string, error) { return d.sh("echo 'Adds and multiplies.' >> /work/proj/README.md") }},
	}
	ids := make([]string, len(steps))
	for i, s := range steps {
		t, err := d.step(s.what, s.act)
		if err != nil {
			return err
		}
		ids[i] = t.ID
	}
	afterShell, beforeVenv, last := ids[11], ids[5], ids[12]

	fmt.Fprintln(d.out, "\nthe agent goes astray: kills the server, deletes the venv, changes the shell")
	d.sh("kill $(cat /tmp/server.pid); rm -rf /work/venv /work/proj/calc")
	d.bash("cd / && export APP_ENV=prod && unset -f greet")

	if err := d.restore("back to after the shell step", afterShell); err != nil {
		return err
	}
	out, _ := d.bash(`echo "$PWD $APP_ENV"; greet demo`)
	d.check("shell cwd, variable, function", out, "/work/proj dev\nhello demo")
	out, _ = d.sh(`python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/README.md', timeout=5).read().decode())"`)
	d.check("server answers", out, "# calc")
	out, _ = d.sh("test -x /work/venv/bin/python && /work/venv/bin/python -c 'import calc; print(calc.add(2, 3))'")
	d.check("venv with the installed package", out, "5")

	if err := d.restore("back to before the venv", beforeVenv); err != nil {
		return err
	}
	out, _ = d.sh("test -e /work/venv && echo venv || echo no-venv; grep -c 'a + b' /work/proj/calc/__init__.py")
	d.check("no venv yet, bug already fixed", out, "no-venv\n1")
	out, _ = d.sh("python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:8000/', timeout=2)\" 2>/dev/null && echo up || echo down")
	d.check("no server yet", out, "down")

	if err := d.restore("forward to the last step", last); err != nil {
		return err
	}
	out, _ = d.sh("tail -1 /work/proj/README.md")
	d.check("last edit present", out, "Adds and multiplies.")

	if forks > 0 {
		fmt.Fprintf(d.out, "\nfork %d rollouts from %s\n", forks, last)
		f, err := d.c.Fork(d.ctx, last, api.ForkRequest{Count: forks, Prefix: d.name + "-r"})
		if err != nil {
			d.fail = append(d.fail, "fork: "+err.Error())
			fmt.Fprintf(d.out, "          fork FAILED: %v\n", err)
		} else {
			d.forks = f.Sandboxes
			fmt.Fprintf(d.out, "          %d sandboxes in %.2f ms\n", len(f.Sandboxes), ms1(f.ElapsedUS))
			for _, n := range f.Sandboxes {
				var o bytes.Buffer
				d.c.Exec(d.ctx, n, api.ExecRequest{Argv: []string{"sh", "-c", "n=$(cat /run/rewind/copy); echo rollout $n >> /work/proj/README.md; tail -1 /work/proj/README.md"}}, &o, &o)
				fmt.Fprintf(d.out, "          %s: %s\n", n, strings.TrimSpace(o.String()))
			}
			if len(f.Sandboxes) > 0 {
				n := f.Sandboxes[len(f.Sandboxes)-1]
				sh, err := d.c.Send(d.ctx, n, "sh", api.SendRequest{Text: `echo "$PWD $APP_ENV"; echo ` + demoMarker, Until: demoMarker, TimeoutMS: 30000})
				if err != nil {
					sh = err.Error()
				}
				d.check(n+": its own copy of the shell", strings.ReplaceAll(sh, demoMarker, ""), "/work/proj dev")
				var o bytes.Buffer
				d.c.Exec(d.ctx, n, api.ExecRequest{Argv: []string{"python3", "-c", "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/README.md', timeout=5).read().decode().splitlines()[0])"}}, &o, &o)
				d.check(n+": its own copy of the server", o.String(), "# calc")
			}
			out, _ = d.sh("tail -1 /work/proj/README.md")
			d.check("the source is untouched by its rollouts", out, "Adds and multiplies.")
		}
	}
	d.summary(time.Since(start))
	if len(d.fail) > 0 {
		return errors.New("demo: " + strings.Join(d.fail, "; "))
	}
	return nil
}

func (d *demo) summary(total time.Duration) {
	count := map[string]int{}
	var callMax, frozen, took int64
	for _, r := range d.rows {
		if r.step == "R" {
			continue
		}
		count[r.decision]++
		callMax = max(callMax, r.callUS)
		frozen += r.frozenUS
		took += r.tookUS
	}
	turns := count["skip"] + count["fs"] + count["full"]
	fmt.Fprintf(d.out, "\nsummary: %d turns: %d skip, %d fs-only, %d full; slowest turn call %.2f ms; frozen %.1f ms in total; checkpoint work %.1f ms in total (async)\n",
		turns, count["skip"], count["fs"], count["full"], ms1(callMax), ms1(frozen), ms1(took))
	for _, r := range d.rows {
		if r.step == "R" {
			fmt.Fprintf(d.out, "         restore %-32s %7.2f ms via %s\n", r.what, ms1(r.restoreUS), r.restorePath)
		}
	}
	fmt.Fprintf(d.out, "         total %.1f s; %d problem(s)\n", total.Seconds(), len(d.fail))
	for _, f := range d.fail {
		fmt.Fprintf(d.out, "         - %s\n", f)
	}
}

func (d *demo) cleanup() {
	ctx := context.WithoutCancel(d.ctx)
	for _, n := range append(d.forks, d.name) {
		d.c.Remove(ctx, n)
	}
	d.c.GC(ctx, false)
}
