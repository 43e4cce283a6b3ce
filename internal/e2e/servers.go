package e2e

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// Server is a Redis, NATS or Postgres server process private to one run,
// on a loopback port, so that it can be crashed and restarted without
// touching the machine's shared servers.
type Server struct {
	*Process
	Addr string // host:port
	URL  string // what the services are configured with
	// Monitor is a nats-server's monitoring endpoint (http://host:port),
	// whose /varz and /jsz count its messages; "" for other servers.
	Monitor string
	tmp     string // a directory of its own, removed by Close
}

// Close kills the server and removes its own directory.
func (s *Server) Close() {
	s.Kill()
	if s.tmp != "" {
		_ = os.RemoveAll(s.tmp)
	}
}

// Up starts the server again after it exited and waits until it accepts
// connections on its port.
func (s *Server) Up(ctx context.Context) error {
	if err := s.Restart(); err != nil {
		return err
	}
	return s.waitListening(ctx)
}

func (s *Server) waitListening(ctx context.Context) error {
	for {
		c, err := net.DialTimeout("tcp", s.Addr, time.Second)
		if err == nil {
			c.Close()
			return nil
		}
		select {
		case <-s.done:
			return fmt.Errorf("%s exited (%v); log:\n%s", s.Name, s.err, Tail(s.LogPath, 20))
		case <-ctx.Done():
			return fmt.Errorf("%s does not listen on %s: %w", s.Name, s.Addr, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func startServer(ctx context.Context, cred *syscall.Credential, name, dir, bin string, port int, url string, args ...string) (*Server, error) {
	s := &Server{
		Process: &Process{Name: name, LogPath: filepath.Join(dir, name+".log"), bin: bin, args: args, env: os.Environ(), cred: cred},
		Addr:    "127.0.0.1:" + strconv.Itoa(port),
		URL:     url,
	}
	if err := s.launch(); err != nil {
		return nil, err
	}
	if err := s.waitListening(ctx); err != nil {
		s.Kill()
		return nil, err
	}
	return s, nil
}

// StartRedis runs a redis-server that keeps nothing on disk: a restart
// after Kill brings it back empty, as a failover to an empty replica does.
// extra are more redis-server arguments (e.g. "--enable-debug-command",
// "yes" for a test that makes the server sleep, or those of a Cluster
// node: its port leaves room for the cluster bus).
func StartRedis(ctx context.Context, dir string, extra ...string) (*Server, error) {
	port, err := redisPort()
	if err != nil {
		return nil, err
	}
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server (run `go tool task deps`): %w", err)
	}
	p := strconv.Itoa(port)
	args := append([]string{"--port", p, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir}, extra...)
	return startServer(ctx, nil, "redis", dir, bin, port, "redis://127.0.0.1:"+p+"/0", args...)
}

// redisPort is a free port whose cluster bus port, 10000 above it, is
// free too.
func redisPort() (int, error) {
	for range 100 {
		p, err := FreePort()
		if err != nil {
			return 0, err
		}
		if p+10000 > 65535 {
			continue
		}
		if bus, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p+10000)); err == nil {
			bus.Close()
			return p, nil
		}
	}
	return 0, fmt.Errorf("no free port for redis-server and its cluster bus")
}

// StartNATS runs a nats-server with JetStream storing in dir/nats, so that
// its streams survive a Kill and restart, and its monitoring endpoint on
// (Server.Monitor); extra are more nats-server arguments (e.g. "-profile",
// a port, for its pprof endpoint).
func StartNATS(ctx context.Context, dir string, extra ...string) (*Server, error) {
	ports, err := FreePorts(2) // the clients' and the monitoring port
	if err != nil {
		return nil, err
	}
	return startNATS(ctx, dir, "nats", ports[0], ports[1], extra...)
}

// startNATS runs a nats-server called name (its log dir/name.log, its
// store dir/name) with extra arguments (a cluster node's).
func startNATS(ctx context.Context, dir, name string, port, mport int, extra ...string) (*Server, error) {
	bin, err := lookPath("nats-server", "/usr/sbin/nats-server")
	if err != nil {
		return nil, err
	}
	p, m := strconv.Itoa(port), strconv.Itoa(mport)
	args := append([]string{"-js", "-sd", filepath.Join(dir, name), "-a", "127.0.0.1", "-p", p, "-m", m}, extra...)
	s, err := startServer(ctx, nil, name, dir, bin, port, "nats://127.0.0.1:"+p, args...)
	if err != nil {
		return nil, err
	}
	s.Monitor = "http://127.0.0.1:" + m
	return s, nil
}

// StartPostgres initializes a cluster in a directory of its own (which
// the postgres user can reach) and runs it, logging into dir; as the
// postgres user when this process is root, since Postgres refuses to run
// as root. Crash it with Signal(syscall.SIGQUIT, …): an immediate
// shutdown, recovered from the WAL at the next start. args are further
// server settings (e.g. "-c", "shared_preload_libraries=pg_stat_statements").
func StartPostgres(ctx context.Context, dir string, args ...string) (*Server, error) {
	bins, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Strings(bins)
	if len(bins) == 0 {
		return nil, fmt.Errorf("no /usr/lib/postgresql/*/bin (run `go tool task deps`)")
	}
	bin := bins[len(bins)-1]
	pgDir, err := os.MkdirTemp("", "quotaflow-pg-")
	if err != nil {
		return nil, err
	}
	cred, err := postgresCredential(pgDir)
	if err != nil {
		os.RemoveAll(pgDir)
		return nil, err
	}
	data := filepath.Join(pgDir, "data")
	initdb := exec.CommandContext(ctx, filepath.Join(bin, "initdb"), "-D", data, "-U", "postgres", "-A", "trust", "--no-sync")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	port, err := FreePort()
	if err == nil {
		if out, ierr := initdb.CombinedOutput(); ierr != nil {
			err = fmt.Errorf("initdb: %w\n%s", ierr, out)
		}
	}
	if err != nil {
		os.RemoveAll(pgDir)
		return nil, err
	}
	p := strconv.Itoa(port)
	s, err := startServer(ctx, cred, "postgres", dir, filepath.Join(bin, "postgres"), port,
		"postgres://postgres@127.0.0.1:"+p+"/postgres?sslmode=disable",
		append([]string{"-D", data, "-p", p, "-k", pgDir, "-c", "listen_addresses=127.0.0.1"}, args...)...)
	if err == nil {
		s.tmp = pgDir
		// It listens before it accepts sessions ("the database system is
		// starting up").
		if err = waitSession(ctx, s.URL); err != nil {
			s.Close()
		}
	}
	if err != nil {
		os.RemoveAll(pgDir)
		return nil, err
	}
	return s, nil
}

// postgresCredential is the postgres user's when this process is root
// (dir is then handed to it), else nil.
func postgresCredential(dir string) (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("running as root needs the postgres user (run `go tool task deps`): %w", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	if err := os.Chown(dir, uid, gid); err != nil {
		return nil, err
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

// lookPath finds name in PATH or at fallback (Debian installs some
// servers in /usr/sbin, which is not in every user's PATH).
func lookPath(name, fallback string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	if _, err := os.Stat(fallback); err != nil {
		return "", fmt.Errorf("%s not found (run `go tool task deps`)", name)
	}
	return fallback, nil
}

func waitSession(ctx context.Context, url string) error {
	for {
		conn, err := pgx.Connect(ctx, url)
		if err == nil {
			return conn.Close(ctx)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("postgres does not accept sessions: %w", err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}
