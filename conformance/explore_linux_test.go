package conformance

import (
	"context"
	"flag"
	"os"
	"path/filepath"
	"testing"
	"time"
)

var (
	exploreSeeds = flag.Int("conformance.seeds", 0, "TestExplore: number of random seeds to run (0 = skip)")
	exploreFirst = flag.Uint64("conformance.seed", 100, "TestExplore: first seed")
	exploreSteps = flag.Int("conformance.steps", 600, "TestExplore: steps per random workload")
	exploreLinks = flag.Bool("conformance.links", false, "TestExplore: add hard links and run the FUSE path only")
)

// TestExplore is a longer randomized run for developers, off by default:
// go test ./conformance -run TestExplore -conformance.seeds 50
func TestExplore(t *testing.T) {
	if *exploreSeeds == 0 {
		t.Skip("set -conformance.seeds N")
	}
	requireFS(t)
	kdir := loopXFS(t)
	for i := range *exploreSeeds {
		seed := *exploreFirst + uint64(i)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		paths := FSPaths
		if *exploreLinks {
			paths = []string{"fuse"}
		}
		w := GenerateWith(seed, *exploreSteps, GenOptions{HardLinks: *exploreLinks})
		res, file, err := RunGenerated(ctx, w, Options{Paths: paths, WorkDir: t.TempDir(), KernelDir: kdir},
			filepath.Join(os.TempDir(), "rewind-conformance-repro"))
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range res.Paths {
			if p.Status != "pass" {
				t.Errorf("seed %d on %s: step %d: %s\nminimized reproducer: %s", seed, p.Path, p.Step, p.Detail, file)
			}
		}
	}
}
