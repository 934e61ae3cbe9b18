package state

import (
	"context"
	"sync"
)

// queue orders the operations on one sandbox: each operation waits for the
// one enqueued before it, so an asynchronous checkpoint started by a turn
// completes before any later exec, restore or removal runs.
type queue struct {
	mu   sync.Mutex
	tail chan struct{}
}

func newQueue() *queue {
	c := make(chan struct{})
	close(c)
	return &queue{tail: c}
}

// enter takes a place in line: prev closes when it is this operation's turn,
// and done must be called exactly once when the operation ends.
func (q *queue) enter() (prev <-chan struct{}, done func()) {
	mine := make(chan struct{})
	q.mu.Lock()
	prev, q.tail = q.tail, mine
	q.mu.Unlock()
	var once sync.Once
	return prev, func() { once.Do(func() { close(mine) }) }
}

// run runs fn in order. If ctx ends before fn's turn comes, fn never runs
// and the place in line is released once the operations before it end.
func (q *queue) run(ctx context.Context, fn func() error) error {
	prev, done := q.enter()
	select {
	case <-prev:
	case <-ctx.Done():
		go func() { <-prev; done() }()
		return ctx.Err()
	}
	defer done()
	return fn()
}

// async runs fn in order in a new goroutine and returns at once.
func (q *queue) async(wg *sync.WaitGroup, fn func()) {
	prev, done := q.enter()
	wg.Add(1)
	go func() {
		defer wg.Done()
		<-prev
		defer done()
		fn()
	}()
}

// idle returns a channel closed when every operation enqueued so far ended.
func (q *queue) idle() <-chan struct{} {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.tail
}
