package limits

// CheckFast returns o with reserves that decide every reserve the engine's
// fast path takes on its general path too, in the same call, and fail the
// call on any difference in the reply or in what they store.
func CheckFast(o Options) Options {
	o.checkFast = true
	return o
}
