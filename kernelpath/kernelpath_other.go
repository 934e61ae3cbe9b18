//go:build !linux

package kernelpath

// ProbeSwitchIoctl reports ErrUnsupported off Linux.
func ProbeSwitchIoctl(dir string) error { return ErrUnsupported }

// SelfTest reports ErrUnsupported off Linux.
func SelfTest(stateDir string) (Report, error) { return Report{}, ErrUnsupported }

// InitStore reports ErrUnsupported off Linux.
func InitStore(opts StoreImage) (StoreConfig, error) { return StoreConfig{}, ErrUnsupported }
