//go:build !linux

package service

// ReleaseStartupPages does nothing outside Linux.
func ReleaseStartupPages() (int64, error) { return 0, nil }
