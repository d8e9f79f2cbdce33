package e2b

import (
	"cmp"
	"encoding/base64"
	"encoding/json"
	"time"
)

// Pagination of the list answers (sandboxes, snapshots): the entries are in a
// stable order (by start or creation time, then id; ascending or descending),
// a page holds at most limit of them and X-Next-Token carries the position
// of its last entry. The next page starts after that position, so entries
// made or deleted between two pages shift nothing: none is listed twice and
// none that existed throughout is skipped.

// cursor is a position in a list: an entry's time and id.
type cursor struct {
	At time.Time `json:"t"`
	ID string    `json:"id"`
}

func (c cursor) token() string {
	b, _ := json.Marshal(c)
	return base64.RawURLEncoding.EncodeToString(b)
}

func parseCursor(tok string) (cursor, error) {
	var c cursor
	b, err := base64.RawURLEncoding.DecodeString(tok)
	if err == nil {
		err = json.Unmarshal(b, &c)
	}
	if err != nil || c.ID == "" {
		return cursor{}, invalid("nextToken %q: not a token this server gave", tok)
	}
	return c, nil
}

// compareCursors orders positions by time, then id; desc reverses it.
func compareCursors(a, b cursor, desc bool) int {
	c := a.At.Compare(b.At)
	if c == 0 {
		c = cmp.Compare(a.ID, b.ID)
	}
	if desc {
		return -c
	}
	return c
}

// paginate returns the page of items (already in the order desc names, each
// at position pos(item)) after the position in token ("" = from the start),
// at most limit long, and the token of the next page ("" when none is left).
// Errors: a token this server did not give.
func paginate[T any](items []T, pos func(T) cursor, desc bool, limit int, token string) ([]T, string, error) {
	start := 0
	if token != "" {
		after, err := parseCursor(token)
		if err != nil {
			return nil, "", err
		}
		for start < len(items) && compareCursors(pos(items[start]), after, desc) <= 0 {
			start++
		}
	}
	items = items[start:]
	if len(items) <= limit {
		return items, "", nil
	}
	page := items[:limit]
	return page, pos(page[len(page)-1]).token(), nil
}
