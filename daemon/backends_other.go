//go:build !linux

package daemon

import (
	"context"
	"errors"
	"log/slog"
)

func realBackends(context.Context, *Config, *slog.Logger) (*backendSet, error) {
	return nil, errors.New("the real back ends need Linux")
}

func mountStore(Config, *slog.Logger) error { return nil }

func storeImage(string) string { return "" }

func breakDeadLock(string, *slog.Logger) bool { return false }
