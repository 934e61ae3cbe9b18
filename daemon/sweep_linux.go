package daemon

import (
	"context"
	"path/filepath"

	"github.com/rewind-sandbox/rewind/cr"
	"github.com/rewind-sandbox/rewind/state"
)

// SweepImages implements state.ImageSweeper: the engine removes the image
// directories (<state>/images/<sandbox>/<cr checkpoint>) of every cr
// checkpoint that no part of keep names and that it neither holds nor is
// writing (cr.Engine.SweepImages). At start, the images it loaded from
// disk that no record uses are dropped, and a directory a record names
// without a complete image (a dump cut short by a crash) goes too: no
// restore could use it.
func (b *procBackend) SweepImages(_ context.Context, keep []*state.ProcPart, start bool) (int, int64, error) {
	ids := map[string]bool{}
	for _, p := range keep {
		if id := p.Data["cr"]; id != "" {
			ids[id] = true
		}
		if p.ImageDir != "" {
			ids[filepath.Base(p.ImageDir)] = true
		}
	}
	if start {
		for id := range b.images {
			if !ids[id] {
				delete(b.images, id)
			}
		}
	}
	res, err := b.eng.SweepImages(cr.SweepOptions{Keep: ids, Start: start})
	return len(res.Removed), res.Bytes, err
}
