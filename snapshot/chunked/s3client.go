package chunked

import "github.com/minio/minio-go/v7"

// Client returns the backend's S3 client and bucket, for other torpor data
// kept in the same bucket outside the store's prefix (images, package image).
// Requests made with it bypass the prefix claim (S3Config.Owner).
func (b *S3) Client() (*minio.Client, string) { return b.c, b.bucket }
