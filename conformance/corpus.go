package conformance

import (
	"embed"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strings"
)

//go:embed testdata/*.json
var corpusFS embed.FS

// Corpus returns the shipped workloads (testdata/*.json, embedded in the
// binary), sorted by name.
func Corpus() ([]*Workload, error) {
	files, err := fs.Glob(corpusFS, "testdata/*.json")
	if err != nil {
		return nil, fmt.Errorf("corpus: %w", err)
	}
	sort.Strings(files)
	var out []*Workload
	for _, f := range files {
		b, err := corpusFS.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("corpus: %w", err)
		}
		w, err := Parse(b)
		if err != nil {
			return nil, fmt.Errorf("corpus %s: %w", f, err)
		}
		if w.Name == "" {
			w.Name = strings.TrimSuffix(path.Base(f), ".json")
		}
		out = append(out, w)
	}
	return out, nil
}
