package inject

import (
	"bufio"
	"io"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/internal/testenv"
	"golang.org/x/sys/unix"
)

// pyStdio answers each line on stdout and on stderr, and when its stdin
// ends lists its descriptors and exits.
const pyStdio = `
import os, sys
x = 41
for l in sys.stdin:
    x += 1
    print(l.strip(), x, flush=True)
    print("err", x, file=sys.stderr, flush=True)
print("fds", " ".join(sorted(os.listdir("/proc/self/fd"), key=int)), flush=True)
`

func TestNewStdioGivesACopyItsOwnPipes(t *testing.T) {
	testenv.RequireRoot(t)
	p := startLines(t, "python3", "-u", "-c", pyStdio)
	if got := p.roundTrip(t, "a"); got != "a 42" {
		t.Fatalf("got %q", got)
	}
	time.Sleep(50 * time.Millisecond) // let it block in read()
	tr := NewTracer()
	defer tr.Close()
	pr, err := tr.Attach(p.cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	child, err := pr.Fork(true)
	if err != nil {
		t.Fatal(err)
	}
	// A sibling: a child of the test process, which reaps it.
	reapLater(t, child.Pid())
	in, out, err := child.NewStdio()
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	// The process holds no descriptor of the pipes but 0, 1 and 2.
	link := func(fd int) string {
		l, _ := os.Readlink("/proc/" + strconv.Itoa(child.Pid()) + "/fd/" + strconv.Itoa(fd))
		return l
	}
	if link(0) == link(1) || link(1) != link(2) || !strings.HasPrefix(link(0), "pipe:") || !strings.HasPrefix(link(1), "pipe:") {
		t.Fatalf("copy's stdio: 0=%s 1=%s 2=%s", link(0), link(1), link(2))
	}
	if err := child.Detach(); err != nil {
		t.Fatal(err)
	}
	if err := pr.Detach(); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(out)
	if got := roundTrip(t, in, r, "c"); got != "c 43" {
		t.Fatalf("copy: got %q", got)
	}
	if got, _ := r.ReadString('\n'); strings.TrimSpace(got) != "err 43" {
		t.Fatalf("copy's stderr: got %q", got)
	}
	if got := p.roundTrip(t, "b"); got != "b 43" {
		t.Fatalf("original: got %q", got)
	}
	// Closing our end of its stdin ends its input: it sees an EOF (no
	// other write end is left in it), lists its descriptors and exits.
	in.Close()
	if err := out.SetReadDeadline(time.Now().Add(30 * time.Second)); err != nil {
		t.Fatal(err)
	}
	rest, err := io.ReadAll(r)
	if err != nil {
		t.Fatalf("copy's output after EOF: %v", err)
	}
	if got := strings.TrimSpace(string(rest)); !strings.HasPrefix(got, "fds 0 1 2") {
		t.Fatalf("copy's last output %q", got)
	}
	var ws unix.WaitStatus
	if _, err := unix.Wait4(child.Pid(), &ws, 0, nil); err != nil || ws.ExitStatus() != 0 {
		t.Fatalf("copy exit: %v %v", ws, err)
	}
}
