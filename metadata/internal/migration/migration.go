// Package migration reads a SQL metadata store's numbered migrations: files
// NNNN_what.sql in one directory of an embedded file system, numbered from
// 0001 without gaps. Each store applies them its own way (metadata/sqlite:
// PRAGMA user_version; metadata/postgres: table schema_migrations); the
// numbers are schema versions, the same in every store.
package migration

import (
	"fmt"
	"io/fs"
	"path"
	"strconv"
	"strings"
)

// Migration is one numbered migration.
type Migration struct {
	Version int    // 1, 2, …
	Name    string // the file name, e.g. 0002_row_versions.sql
	SQL     string
}

// Load returns the migrations in dir of fsys, in order. Errors: a file name
// without a number, numbers that do not run 1, 2, 3 …, an unreadable file.
func Load(fsys fs.FS, dir string) ([]Migration, error) {
	names, err := fs.Glob(fsys, path.Join(dir, "*.sql"))
	if err != nil {
		return nil, err
	}
	var out []Migration
	for i, name := range names { // Glob returns them sorted
		base := path.Base(name)
		num, _, _ := strings.Cut(base, "_")
		v, err := strconv.Atoi(num)
		if err != nil || v != i+1 {
			return nil, fmt.Errorf("migration %s: want number %04d", base, i+1)
		}
		b, err := fs.ReadFile(fsys, name)
		if err != nil {
			return nil, err
		}
		out = append(out, Migration{Version: v, Name: base, SQL: string(b)})
	}
	return out, nil
}
