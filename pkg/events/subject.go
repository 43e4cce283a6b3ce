package events

// Subjects are named under a prefix, the first token(s) of every subject
// of one deployment ("quotaflow" unless configured otherwise; package
// stream holds the default). These functions are the only place a subject
// is spelled out.

// subjectSuffix maps a type to the last token of its subject.
func subjectSuffix(typ string) string {
	switch typ {
	case TypeReserved:
		return "reserved"
	case TypeDenied:
		return "denied"
	case TypeActual:
		return "actual"
	case TypeReleased:
		return "released"
	case TypeCorrected:
		return "corrected"
	case TypeTopUp:
		return "topup"
	}
	return ""
}

// Subject returns the NATS subject of events of type typ under prefix, e.g.
// "quotaflow.usage.actual"; top-ups travel on "<prefix>.usage.topup" so
// that one stream and one consumer filter cover every event. It returns ""
// for an unknown type.
func Subject(prefix, typ string) string {
	s := subjectSuffix(typ)
	if s == "" {
		return ""
	}
	return prefix + ".usage." + s
}

// UsageSubjects returns the filter of every usage event under prefix,
// "<prefix>.usage.>".
func UsageSubjects(prefix string) string { return prefix + ".usage.>" }

// DLQSubject returns "<prefix>.dlq.<reason>", the subject of a dead letter.
// Characters of reason other than A-Z a-z 0-9 _ - become '_', so any
// reason is one valid token; an empty one becomes "unknown".
func DLQSubject(prefix, reason string) string {
	if reason == "" {
		reason = "unknown"
	}
	b := []byte(reason)
	for i, ch := range b {
		if !(ch >= 'a' && ch <= 'z' || ch >= 'A' && ch <= 'Z' || ch >= '0' && ch <= '9' || ch == '_' || ch == '-') {
			b[i] = '_'
		}
	}
	return prefix + ".dlq." + string(b)
}

// DLQSubjects returns the filter of every dead letter under prefix,
// "<prefix>.dlq.>".
func DLQSubjects(prefix string) string { return prefix + ".dlq.>" }
