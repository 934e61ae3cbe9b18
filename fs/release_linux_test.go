package fs

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// TestReleasesMarkUntilEnd checks the bookkeeping: a Release inside a
// bracketed request marks its node until end, any other does not.
func TestReleasesMarkUntilEnd(t *testing.T) {
	r := releases{m: map[<-chan struct{}]*node{}}
	n := &node{}
	req := make(chan struct{})
	other := make(chan struct{})
	tests := []struct {
		name string
		ctx  context.Context
		want bool
	}{
		{"not a fuse request", context.Background(), false},
		{"request without cancel", &fuse.Context{}, false},
		{"request not bracketed", &fuse.Context{Cancel: other}, false},
		{"bracketed request", &fuse.Context{Cancel: req}, true},
		{"second handle in the same request", &fuse.Context{Cancel: req}, false},
	}
	r.begin(req)
	for _, tc := range tests {
		got := r.attach(tc.ctx, n)
		if got != tc.want {
			t.Errorf("%s: attach = %v, want %v", tc.name, got, tc.want)
		}
	}
	if n.releasing != 1 {
		t.Fatalf("releasing = %d after attach, want 1", n.releasing)
	}
	r.end(other) // not bracketed: no effect
	if n.releasing != 1 {
		t.Fatalf("releasing = %d after another request ended, want 1", n.releasing)
	}
	r.end(req)
	if n.releasing != 0 || len(r.m) != 0 {
		t.Fatalf("after end: releasing = %d, %d requests left, want 0 and 0", n.releasing, len(r.m))
	}
}

// TestPassthroughOpenCloseStorm opens, reads and closes the same files
// from several goroutines, some handles for writing, while checkpoints
// move the open passthrough files into a new upper: every open succeeds
// (no handle may reuse or lose a backing file go-fuse is still
// releasing) and every read sees the file's one content.
func TestPassthroughOpenCloseStorm(t *testing.T) {
	const files = 4
	content := func(i int) string { return fmt.Sprintf("content %d %s", i, strings.Repeat("c", 3000)) }
	fx := mountT(t, nil, Options{Passthrough: true, PassthroughLower: true})
	for i := 0; i < files; i++ {
		mustWrite(t, fx.p(fmt.Sprintf("s%d", i)), content(i))
	}
	var wg, readers sync.WaitGroup
	errs := make(chan error, 8)
	stop := make(chan struct{})
	for g := 0; g < 4; g++ {
		readers.Add(1)
		go func(g int) {
			defer readers.Done()
			buf := make([]byte, 8192)
			for k := 0; k < 600; k++ {
				i := (k + g) % files
				flag := os.O_RDONLY
				if (k+g)%3 == 0 {
					flag = os.O_RDWR
				}
				fh, err := os.OpenFile(fx.p(fmt.Sprintf("s%d", i)), flag, 0)
				if err != nil {
					errs <- fmt.Errorf("goroutine %d open %d: %w", g, k, err)
					return
				}
				nr, err := fh.ReadAt(buf, 0)
				fh.Close()
				if got := string(buf[:nr]); got != content(i) {
					errs <- fmt.Errorf("goroutine %d read %d of s%d: %.20q (%v)", g, k, i, got, err)
					return
				}
			}
		}(g)
	}
	// Checkpoints all along: each leaves the files no handle holds in a
	// frozen layer, where a node that had passthrough handles serves
	// reads with plain handles until a writer copies the file up again.
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := fx.fs.Checkpoint(); err != nil {
				errs <- err
				return
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
	readers.Wait()
	close(stop)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}
