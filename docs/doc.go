// Package docs holds quotaflow's contract, design.md. Its test keeps the
// contract's pointers into the code, and the code's pointers back, true.
package docs
