package openai

// Kind is an OpenAI-compatible endpoint the codec understands.
type Kind uint8

// The endpoints, by their path under /v1.
const (
	Chat        Kind = iota + 1 // /v1/chat/completions
	Completions                 // /v1/completions
	Embeddings                  // /v1/embeddings
	Responses                   // /v1/responses
)

var paths = map[string]Kind{
	"/v1/chat/completions": Chat,
	"/v1/completions":      Completions,
	"/v1/embeddings":       Embeddings,
	"/v1/responses":        Responses,
}

// KindOf is the endpoint of a request path (what follows the proxy's
// prefix, "/v1/..."), matched exactly: no trailing slash, no query.
func KindOf(path string) (Kind, bool) {
	k, ok := paths[path]
	return k, ok
}

// String is the endpoint's path.
func (k Kind) String() string {
	for p, kk := range paths {
		if kk == k {
			return p
		}
	}
	return "unknown"
}
