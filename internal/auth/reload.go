package auth

import (
	"context"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"net/http"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"quotaflow/internal/filewatch"
	"quotaflow/pkg/yamldoc"
)

// Options configure an Auth.
type Options struct {
	// Tokens are the QF_API_TOKENS entries, already split at commas.
	Tokens []string
	// File is QF_API_TOKENS_FILE, or "" for none.
	File string
	// Log receives the file's reloads and rejections (never a token); nil
	// discards them.
	Log *slog.Logger
	// OnReload, when set, is called after every reload that found new
	// content in the file: with nil when its tokens are now in force, with
	// the error when it was rejected (for a reload counter). It runs under
	// the reload lock: keep it short and do not call Reload from it.
	OnReload func(err error)
	// Debounce is how long Watch waits after the last change to the file's
	// directory before it reloads (default 100 ms), so that one save costs
	// one reload of the finished file.
	Debounce time.Duration
}

// Auth authenticates API requests: a request's bearer token must be one of
// QF_API_TOKENS or of QF_API_TOKENS_FILE (the union of both is in force),
// and grants what its entries grant (Principal).
//
// The file is reloaded on change and on SIGHUP (Watch) so that tokens
// rotate without a restart: valid new content replaces the file's tokens
// in one atomic swap, while content that does not parse leaves the last
// good set in force and is logged and reported to OnReload. Authenticate
// loads the set once per request and never blocks on a reload.
//
// A nil *Auth is no authentication: every request may do everything (New
// returns nil when there is neither a token nor a file). Create one with
// New; its methods are safe for concurrent use.
type Auth struct {
	env      []Entry
	path     string // absolute; "" without a file
	log      *slog.Logger
	onReload func(error)
	debounce time.Duration

	cur atomic.Pointer[Set]

	mu      sync.Mutex // serializes reloads; guards the fields below
	tried   bool       // some content of the file was judged
	lastSum [sha256.Size]byte
	lastErr error
}

// New parses the QF_API_TOKENS entries and loads the file; either failing
// is an error, as a service should not start with tokens it cannot read.
// It returns nil and no error when there is neither an entry nor a file: no
// authentication. It logs how many tokens are in force, and warns when
// none is or when nothing is authenticated.
func New(o Options) (*Auth, error) {
	env, err := ParseEntries(o.Tokens)
	if err != nil {
		return nil, err
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if len(env) == 0 && o.File == "" {
		o.Log.Warn("QF_API_TOKENS and QF_API_TOKENS_FILE are empty: the API accepts requests without authentication")
		return nil, nil
	}
	if o.Debounce <= 0 {
		o.Debounce = 100 * time.Millisecond
	}
	a := &Auth{env: env, log: o.Log.With("component", "tokens"), debounce: o.Debounce}
	a.cur.Store(NewSet(env))
	if o.File != "" {
		if a.path, err = filepath.Abs(o.File); err != nil {
			return nil, fmt.Errorf("QF_API_TOKENS_FILE %s: %w", o.File, err)
		}
		a.log = a.log.With("path", a.path)
		if err := a.Reload(); err != nil {
			return nil, err
		}
	}
	a.onReload = o.OnReload // not for the first load: nothing was reloaded
	if a.Len() == 0 {
		a.log.Warn("no API token is in force: every request gets 401 until QF_API_TOKENS_FILE holds one")
	} else {
		a.log.Info("api tokens in force", "tokens", a.Len())
	}
	return a, nil
}

// Len is the number of distinct tokens in force.
func (a *Auth) Len() int {
	if a == nil {
		return 0
	}
	return a.cur.Load().Len()
}

// Authenticate returns the principal of r's "Authorization: Bearer" token;
// ok is false when the token is missing or unknown (401). The token is
// compared with every token in force (Set).
func (a *Auth) Authenticate(r *http.Request) (p Principal, ok bool) {
	return a.AuthenticateHeader(r.Header.Get("Authorization"))
}

// AuthenticateHeader is Authenticate for the value of an authorization
// header ("Bearer <token>"), as gRPC metadata carries it.
func (a *Auth) AuthenticateHeader(header string) (p Principal, ok bool) {
	if a == nil {
		return Principal{grants: everyone}, true
	}
	tok, ok := bearer(header)
	if !ok {
		return Principal{}, false
	}
	return a.AuthenticateToken(tok)
}

// AuthenticateToken is Authenticate for a bare token, as the console's
// cookie carries it; ok is false when tok is empty or unknown.
func (a *Auth) AuthenticateToken(tok string) (p Principal, ok bool) {
	if a == nil {
		return Principal{grants: everyone}, true
	}
	if tok == "" {
		return Principal{}, false
	}
	grants, ok := a.cur.Load().lookup(tok)
	return Principal{grants: grants}, ok
}

// Reload re-reads the file and, when it parses, puts the union of its
// tokens and QF_API_TOKENS in force. When it does not, the tokens in force
// stay and Reload returns the error, naming the file and every mistake (it
// does not log it: the caller decides). Content identical to the last
// content judged is not parsed again: Reload returns that verdict. Without
// a file it does nothing.
func (a *Auth) Reload() error {
	if a == nil || a.path == "" {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	data, err := a.read()
	if err != nil {
		// Perhaps missing for a moment mid-rename: judge the next read afresh.
		a.tried = false
		return err
	}
	sum := sha256.Sum256(data)
	if a.tried && sum == a.lastSum {
		return a.lastErr
	}
	entries, err := ParseFile(data)
	if err != nil {
		err = fmt.Errorf("QF_API_TOKENS_FILE %s: %w", a.path, err)
	}
	a.tried, a.lastSum, a.lastErr = true, sum, err
	if err == nil {
		set := NewSet(a.env, entries)
		old := a.cur.Swap(set)
		a.log.Info("tokens file loaded", "entries", len(entries), "tokens", set.Len(), "previous_tokens", old.Len())
	}
	if a.onReload != nil {
		a.onReload(err)
	}
	return err
}

// read reads the file, at most one byte past MaxFileSize so that ParseFile
// can tell it is too large.
func (a *Auth) read() ([]byte, error) {
	data, err := yamldoc.ReadFile(a.path, MaxFileSize)
	if err != nil {
		return nil, fmt.Errorf("QF_API_TOKENS_FILE: %w", err)
	}
	return data, nil
}

// Watch keeps the file's tokens current until ctx ends: it reloads after
// each change of the file and on SIGHUP, logging content it rejected at
// Error. It watches the file's directory rather than the file, so that
// editors' rename-on-save and Kubernetes Secret volume updates (a swapped
// "..data" symlink) count as changes. Without a file it returns at once.
// Call it once, on a goroutine its owner waits for.
func (a *Auth) Watch(ctx context.Context) {
	if a == nil || a.path == "" {
		return
	}
	filewatch.OnSIGHUP(ctx, a.log, "tokens file", func(ctx context.Context) error {
		return filewatch.Run(ctx, a.path, a.debounce, a.log, "tokens file", a.reloadAndLog)
	}, a.reloadAndLog)
}

func (a *Auth) reloadAndLog() {
	if err := a.Reload(); err != nil {
		a.log.Error("tokens file rejected; the last good tokens stay in force", "err", err, "tokens", a.Len())
	}
}

// Tokens are the tokens' environment variables, which admission's and the
// accounter's Config embed: both services accept the same tokens.
type Tokens struct {
	// APITokens are token[@tenant][#role+role] entries (ParseEntry). With
	// APITokensFile empty too there is no authentication, and a warning at
	// start.
	APITokens []string `envconfig:"API_TOKENS"`
	// APITokensFile is a YAML list of token entries (ParseFile), reloaded
	// on change and SIGHUP; its tokens add to APITokens. It is read at
	// start, not by Validate.
	APITokensFile string `envconfig:"API_TOKENS_FILE"`
}

// Validate checks the QF_API_TOKENS entries.
func (t Tokens) Validate() error {
	_, err := ParseEntries(t.APITokens)
	return err
}

// Options are New's options for these tokens.
func (t Tokens) Options(log *slog.Logger, onReload func(error)) Options {
	return Options{Tokens: t.APITokens, File: t.APITokensFile, Log: log, OnReload: onReload}
}
