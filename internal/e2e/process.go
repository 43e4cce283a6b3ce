// Package e2e runs the quotaflow services as processes for the demo and
// the chaos suite: building and starting them and private Redis, NATS and
// Postgres servers, a traffic generator that plays a gateway and an LLM
// service, a webhook receiver that verifies and dedups alerts, and readers
// of the ledger and the metrics. It also holds what every test shares
// (shared.go): free ports, random names, a buffer for concurrent output
// and a bounded wait.
//
// redistest, natstest and pgtest build on it, and the tests of pkg/limits
// use them: it must not import pkg/limits.
package e2e

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

// Process is a child process that can be killed and started again: a
// quotaflow service or a server the chaos suite runs privately.
type Process struct {
	Name    string
	Cmd     *exec.Cmd // the current process
	LogPath string    // stdout and stderr of every start, appended
	bin     string
	args    []string
	env     []string
	cred    *syscall.Credential // nil: this process's user
	done    chan struct{}       // closed when the current process has exited
	err     error               // its exit status, once done
}

// Service is a quotaflow service process.
type Service struct {
	*Process
	Ops string // base URL of /metrics, /healthz, /readyz
}

// ModuleRoot is the directory of go.mod, where the services are built
// from: the demo runs from the repository root, its test from cmd/demo.
func ModuleRoot(ctx context.Context) (string, error) {
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

// Build compiles the three services into binDir with one go build, so
// they share one compilation of the common packages.
func Build(ctx context.Context, root, binDir string) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-o", binDir+string(filepath.Separator), "./services/...")
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go build ./services/...: %w\n%s", err, stderr.String())
	}
	return nil
}

// Start runs bin with env added to a clean QF_ environment, logging to
// logDir/name.log.
func Start(name, bin, logDir, opsAddr string, env []string) (*Service, error) {
	p := &Process{Name: name, LogPath: filepath.Join(logDir, name+".log"), bin: bin}
	// The services must see only this run's configuration, not QF_
	// variables of the caller's shell (another stream, another database).
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "QF_") {
			p.env = append(p.env, kv)
		}
	}
	p.env = append(p.env, env...)
	return &Service{Process: p, Ops: "http://" + opsAddr}, p.launch()
}

// Restart starts the process again, with the same command, once it has
// exited (after Kill or Stop); the log goes on.
func (p *Process) Restart() error {
	<-p.done
	return p.launch()
}

func (p *Process) launch() error {
	logf, err := os.OpenFile(p.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	cmd := exec.Command(p.bin, p.args...)
	cmd.Env = p.env
	cmd.Stdout, cmd.Stderr = logf, logf
	// Own process group: a Ctrl-C on the terminal reaches the demo only,
	// which then stops the services in order (and --keep survives it).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: p.cred}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", p.Name, err)
	}
	done := make(chan struct{})
	p.Cmd, p.done, p.err = cmd, done, nil
	go func() {
		err := cmd.Wait()
		logf.Close()
		p.err = err
		close(done)
	}()
	return nil
}

// WaitReady polls /readyz until 200, the process exits or ctx ends.
func (s *Service) WaitReady(ctx context.Context) error {
	c := &http.Client{Timeout: 2 * time.Second}
	for {
		resp, err := c.Get(s.Ops + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-s.done:
			return fmt.Errorf("%s exited before ready (%v); log:\n%s", s.Name, s.err, Tail(s.LogPath, 20))
		case <-ctx.Done():
			return fmt.Errorf("%s not ready: %w; log:\n%s", s.Name, ctx.Err(), Tail(s.LogPath, 20))
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// WaitSteady waits until /readyz no longer reports a degraded dependency
// (e.g. admission deciding locally until the accounter has marked the
// Redis), so the traffic sees Redis's exact decisions. It returns the last
// degradation when that takes longer than timeout: the demo then runs
// anyway, degraded decisions are still correct ones.
func (s *Service) WaitSteady(ctx context.Context, timeout time.Duration) string {
	c := &http.Client{Timeout: 2 * time.Second}
	deadline := time.Now().Add(timeout)
	last := "no answer"
	for time.Now().Before(deadline) && ctx.Err() == nil {
		resp, err := c.Get(s.Ops + "/readyz")
		if err != nil {
			last = err.Error()
		} else {
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

// Stop sends SIGTERM and waits for the graceful shutdown (bounded by the
// service's own QF_SHUTDOWN_TIMEOUT steps), then SIGKILL after timeout.
func (p *Process) Stop(timeout time.Duration) error {
	return p.Signal(syscall.SIGTERM, timeout)
}

// Signal sends sig and waits until the process has exited, sending
// SIGKILL after timeout.
func (p *Process) Signal(sig syscall.Signal, timeout time.Duration) error {
	select {
	case <-p.done:
		return p.err
	default:
	}
	_ = p.Cmd.Process.Signal(sig)
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		_ = p.Cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("%s did not stop within %v: killed", p.Name, timeout)
	}
}

// Tail returns the last n lines of the file at path.
func Tail(path string, n int) string {
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

// Kill sends SIGKILL (a crash: no graceful shutdown) and waits until the
// process is gone.
func (p *Process) Kill() {
	_ = p.Cmd.Process.Kill()
	<-p.done
}
