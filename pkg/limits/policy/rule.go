package policy

// Rule is a Limit bound to the place its counter lives: its scope and, for
// endpoint limits, the endpoint. The engine takes Rules; Policy.Resolve
// builds them for a request.
type Rule struct {
	Limit
	Scope    Scope
	Endpoint string // set for endpoint limits (global and per-user), else empty
}
