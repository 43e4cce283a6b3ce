package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// service is one child process of the demo.
type service struct {
	name    string
	cmd     *exec.Cmd
	ops     string // base URL of /metrics, /healthz, /readyz
	logPath string
	done    chan struct{} // closed when the process has exited
	err     error         // its exit status, once done
}

// moduleRoot is the directory of go.mod, where the services are built
// from: the demo runs from the repository root, its test from cmd/demo.
func moduleRoot(ctx context.Context) (string, error) {
	out, err := exec.CommandContext(ctx, "go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", fmt.Errorf("not inside the quotaflow module")
	}
	return filepath.Dir(gomod), nil
}

// build compiles the three services into binDir with one go build, so
// they share one compilation of the common packages.
func build(ctx context.Context, root, binDir string) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-o", binDir+string(filepath.Separator), "./services/...")
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go build ./services/...: %w\n%s", err, stderr.String())
	}
	return nil
}

// start runs bin with env added to a clean QF_ environment, logging to
// logDir/name.log.
func start(name, bin, logDir, opsAddr string, env []string) (*service, error) {
	s := &service{name: name, ops: "http://" + opsAddr, logPath: filepath.Join(logDir, name+".log"), done: make(chan struct{})}
	logf, err := os.Create(s.logPath)
	if err != nil {
		return nil, err
	}
	s.cmd = exec.Command(bin)
	// The services must see only this run's configuration, not QF_
	// variables of the caller's shell (another stream, another database).
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "QF_") {
			s.cmd.Env = append(s.cmd.Env, kv)
		}
	}
	s.cmd.Env = append(s.cmd.Env, env...)
	s.cmd.Stdout, s.cmd.Stderr = logf, logf
	// Own process group: a Ctrl-C on the terminal reaches the demo only,
	// which then stops the services in order (and --keep survives it).
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := s.cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() {
		s.err = s.cmd.Wait()
		logf.Close()
		close(s.done)
	}()
	return s, nil
}

// waitReady polls /readyz until 200, the process exits or ctx ends.
func (s *service) waitReady(ctx context.Context) error {
	c := &http.Client{Timeout: 2 * time.Second}
	for {
		resp, err := c.Get(s.ops + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-s.done:
			return fmt.Errorf("%s exited before ready (%v); log:\n%s", s.name, s.err, tail(s.logPath, 20))
		case <-ctx.Done():
			return fmt.Errorf("%s not ready: %w; log:\n%s", s.name, ctx.Err(), tail(s.logPath, 20))
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// waitSteady waits until /readyz no longer reports a degraded dependency
// (e.g. admission deciding locally until the accounter has marked the
// Redis), so the traffic sees Redis's exact decisions. It returns the last
// degradation when that takes longer than timeout: the demo then runs
// anyway, degraded decisions are still correct ones.
func (s *service) waitSteady(ctx context.Context, timeout time.Duration) string {
	c := &http.Client{Timeout: 2 * time.Second}
	deadline := time.Now().Add(timeout)
	last := ""
	for time.Now().Before(deadline) && ctx.Err() == nil {
		resp, err := c.Get(s.ops + "/readyz")
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK && !bytes.Contains(b, []byte("degraded")) {
				return ""
			}
			last = strings.TrimSpace(string(b))
		}
		time.Sleep(200 * time.Millisecond)
	}
	return last
}

// stop sends SIGTERM and waits for the graceful shutdown (bounded by the
// service's own QF_SHUTDOWN_TIMEOUT steps), then SIGKILL after timeout.
func (s *service) stop(timeout time.Duration) error {
	select {
	case <-s.done:
		return s.err
	default:
	}
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
		return s.err
	case <-time.After(timeout):
		_ = s.cmd.Process.Kill()
		<-s.done
		return fmt.Errorf("%s did not stop within %v: killed", s.name, timeout)
	}
}

// tail returns the last n lines of the file at path.
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
