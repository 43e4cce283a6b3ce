package pgtest

import (
	"context"
	"encoding/json"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Plan is what Postgres did to run a query: EXPLAIN (ANALYZE, FORMAT JSON).
type Plan struct {
	Root          map[string]any // the top plan node
	ExecutionTime float64        // ms
	JSON          []byte         // the whole plan, for a failure's message
}

// Explain runs sql with args under EXPLAIN ANALYZE on pool and returns its
// plan: a custom plan, made for args.
func Explain(t testing.TB, pool *pgxpool.Pool, sql string, args ...any) Plan {
	t.Helper()
	var raw []byte
	if err := pool.QueryRow(context.Background(), "EXPLAIN (ANALYZE, FORMAT JSON) "+sql, args...).Scan(&raw); err != nil {
		t.Fatalf("explain %s: %v", sql, err)
	}
	return parsePlan(t, raw)
}

// ExplainGeneric is Explain of the generic plan, made for any args: the
// plan a prepared statement (pgx prepares every query) may settle on after
// a few runs.
func ExplainGeneric(t testing.TB, pool *pgxpool.Pool, sql string, args ...any) Plan {
	t.Helper()
	ctx := context.Background()
	c, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	params := make([]string, len(args))
	for i := range args {
		params[i] = "$" + strconv.Itoa(i+1)
	}
	var raw []byte
	_, err = c.Exec(ctx, "SET plan_cache_mode = force_generic_plan")
	if err == nil {
		_, err = c.Exec(ctx, "PREPARE qf_explained AS "+sql)
	}
	if err == nil {
		// EXECUTE's parameters are not a statement's: pgx writes them in.
		err = c.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE qf_explained("+strings.Join(params, ", ")+")",
			append([]any{pgx.QueryExecModeSimpleProtocol}, args...)...).Scan(&raw)
	}
	if err != nil {
		t.Fatalf("explain the generic plan of %s: %v", sql, err)
	}
	if _, err := c.Exec(ctx, "DEALLOCATE qf_explained; RESET plan_cache_mode"); err != nil {
		t.Fatal(err)
	}
	return parsePlan(t, raw)
}

func parsePlan(t testing.TB, raw []byte) Plan {
	t.Helper()
	var top []struct {
		Plan          map[string]any `json:"Plan"`
		ExecutionTime float64        `json:"Execution Time"`
	}
	if err := json.Unmarshal(raw, &top); err != nil || len(top) != 1 {
		t.Fatalf("plan %s: %v", raw, err)
	}
	return Plan{Root: top[0].Plan, ExecutionTime: top[0].ExecutionTime, JSON: raw}
}

// Walk calls f on every node of p, the root first.
func (p Plan) Walk(f func(node map[string]any)) {
	walk(p.Root, f)
}

func walk(node map[string]any, f func(map[string]any)) {
	f(node)
	kids, _ := node["Plans"].([]any)
	for _, k := range kids {
		if m, ok := k.(map[string]any); ok {
			walk(m, f)
		}
	}
}

// SeqScans returns the tables p reads whole, once per scan.
func (p Plan) SeqScans() []string {
	var out []string
	p.Walk(func(n map[string]any) {
		if n["Node Type"] == "Seq Scan" {
			rel, _ := n["Relation Name"].(string)
			out = append(out, rel)
		}
	})
	return out
}

// RowsRemoved is the number of rows p read and then dropped by a filter,
// summed over its nodes (and their loops).
func (p Plan) RowsRemoved() float64 {
	var sum float64
	p.Walk(func(n map[string]any) {
		r, _ := n["Rows Removed by Filter"].(float64)
		loops, _ := n["Actual Loops"].(float64)
		sum += r * max(loops, 1)
	})
	return sum
}

// DiskSorts counts the sorts of p that spilled to disk (an external sort).
func (p Plan) DiskSorts() int {
	n := 0
	p.Walk(func(node map[string]any) {
		if node["Sort Space Type"] == "Disk" {
			n++
		}
	})
	return n
}

// RowsRead is the number of rows p read from table rel, kept or dropped,
// over all the loops of its scans.
func (p Plan) RowsRead(rel string) float64 {
	var sum float64
	p.Walk(func(n map[string]any) {
		if n["Relation Name"] != rel {
			return
		}
		kept, _ := n["Actual Rows"].(float64)
		dropped, _ := n["Rows Removed by Filter"].(float64)
		rechecked, _ := n["Rows Removed by Index Recheck"].(float64)
		loops, _ := n["Actual Loops"].(float64)
		sum += (kept + dropped + rechecked) * max(loops, 1)
	})
	return sum
}
