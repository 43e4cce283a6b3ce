package detect

import (
	"maps"
	"slices"

	"quotaflow/pkg/limits/policy"
	"quotaflow/services/alerter/internal/store"
)

// legacyThresholds are the percentages every limit alerts at when the
// alerter reads no policy (QF_POLICY_FILE unset): without it the alerter
// cannot tell a limit's kind, so it cannot apply the defaults by kind.
var legacyThresholds = policy.DefaultAlerts

// alertPolicy finds the rule of a snapshot's limit in one policy: its
// thresholds (policy.Limit.AlertThresholds) and what its reset time means
// (by its kind, which snapshots do not carry). A snapshot names a limit by
// scope, endpoint and name, and says whose it is (tenant, user) but, for a
// plan's limit, not always its plan (a reserved event does, a corrected
// one does not):
//   - tenant scope: the tenant's entry, by name;
//   - user scope with an endpoint: that endpoint's user list, by name;
//   - user scope without one: a plan's limit of that name, from the
//     event's plan, else the tenant's plan (its entry's, else
//     default_plan), else the first plan in name order that has it.
//
// A limit the policy does not define (a reload removed it) alerts at
// nothing; Detector.Prune re-arms it.
type alertPolicy struct {
	tenant   map[[2]string]limitRule // (tenant, name)
	endpoint map[[2]string]limitRule // (endpoint, name)
	plan     map[[2]string]limitRule // (plan, name)
	anyPlan  map[string]limitRule    // name → in the first plan, by name, that has it
	planOf   map[string]string       // tenant → its plan, when it names one
	dflt     string                  // default_plan
}

// limitRule is how a limit alerts: at thresholds, re-armed by resets.
type limitRule struct {
	thresholds []int
	resets     resets
}

func ruleOf(l *policy.Limit) limitRule {
	return limitRule{thresholds: l.AlertThresholds(), resets: resetsOf(l.Kind)}
}

// legacyRule is every limit's when the alerter reads no policy.
var legacyRule = limitRule{thresholds: legacyThresholds, resets: resetsGuessed}

func newAlertPolicy(p *policy.Policy) *alertPolicy {
	ap := &alertPolicy{
		tenant: map[[2]string]limitRule{}, endpoint: map[[2]string]limitRule{}, plan: map[[2]string]limitRule{},
		anyPlan: map[string]limitRule{}, planOf: map[string]string{}, dflt: p.DefaultPlan,
	}
	for _, name := range slices.Sorted(maps.Keys(p.Plans)) {
		pl := p.Plans[name]
		if pl == nil {
			continue
		}
		for _, l := range slices.Concat(pl.Quotas, pl.Rates) {
			ap.plan[[2]string{name, l.Name}] = ruleOf(&l)
			if _, ok := ap.anyPlan[l.Name]; !ok {
				ap.anyPlan[l.Name] = ruleOf(&l)
			}
		}
	}
	for id, t := range p.Tenants {
		if t == nil {
			continue
		}
		if t.Plan != "" {
			ap.planOf[id] = t.Plan
		}
		for _, l := range slices.Concat(t.Quotas, t.Rates) {
			ap.tenant[[2]string{id, l.Name}] = ruleOf(&l)
		}
	}
	for path, e := range p.Endpoints {
		if e == nil {
			continue
		}
		for _, l := range e.User {
			ap.endpoint[[2]string{path, l.Name}] = ruleOf(&l)
		}
	}
	return ap
}

// rule returns the rule of a limit of scope, endpoint and name in a
// snapshot of tenant's, decided under plan ("" when unknown). A nil
// alertPolicy (no policy read) gives legacyRule; a limit it does not
// define, the zero rule (no thresholds).
func (ap *alertPolicy) rule(tenant, plan, scope, endpoint, name string) limitRule {
	switch {
	case ap == nil:
		return legacyRule
	case scope == "tenant":
		return ap.tenant[[2]string{tenant, name}]
	case endpoint != "":
		return ap.endpoint[[2]string{endpoint, name}]
	}
	if r, ok := ap.plan[[2]string{plan, name}]; ok {
		return r
	}
	own, ok := ap.planOf[tenant]
	if !ok {
		own = ap.dflt
	}
	if r, ok := ap.plan[[2]string{own, name}]; ok {
		return r
	}
	return ap.anyPlan[name]
}

// defined returns the tenant- and user-scope limits the policy defines.
func (ap *alertPolicy) defined() store.Defined {
	var d store.Defined
	for name := range ap.anyPlan {
		d.Define("user", "", name)
	}
	for k := range ap.endpoint {
		d.Define("user", k[0], k[1])
	}
	for k := range ap.tenant {
		d.Define("tenant", k[0], k[1])
	}
	return d
}
