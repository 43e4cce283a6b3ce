// Package ident is quotaflow's one rule for identifiers: tenants, users,
// endpoints, request ids, plans, models, top-up references, limit names
// and the other strings that name things in requests, events and policies
// (docs/design.md §4).
//
// An identifier is valid UTF-8 of at most MaxLen bytes without control
// characters (Unicode category Cc: U+0000–U+001F and U+007F–U+009F, NUL
// included). Control characters are refused because they break what
// identifiers flow into: Postgres rejects NUL in text, and a tab, newline
// or escape sequence corrupts log lines, header values and the operator's
// terminal. Any other character is allowed, so two different identifiers
// never collide.
//
// Every boundary (the admission API's bodies, query parameters and
// headers, the decider, the limits engine, the event decoder and the
// policy validator) calls Check and phrases the sentinel it returns as
// "<field>: <problem>" in its own error style. Whether an empty identifier
// is allowed is the boundary's call: Check accepts "".
package ident
