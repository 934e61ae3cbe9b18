package layer

import (
	"testing"
	"time"
)

// BenchmarkCheckpointRecord reads a checkpoint record of a stack of
// twelve layers, as every switch of a mount does.
func BenchmarkCheckpointRecord(b *testing.B) {
	st, err := OpenStore(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	var layers []string
	for i := 0; i < 12; i++ {
		l, err := st.NewLayer("")
		if err != nil {
			b.Fatal(err)
		}
		layers = append(layers, l)
	}
	c := Checkpoint{ID: NewID(), Mount: NewID(), Parent: NewID(), Created: time.Now().UTC(), Layers: layers}
	if err := st.SaveCheckpoint(c); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := st.Checkpoint(c.ID); err != nil {
			b.Fatal(err)
		}
	}
}
