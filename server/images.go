package server

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/torpor/torpor/image"
	"github.com/torpor/torpor/snapshot/chunked"
)

// DefaultImagePrefix is the key prefix in the S3 bucket under which servers
// share images (StoreConfig.S3ImagePrefix): the same for every server on the
// bucket, whatever its snapshot store's --s3-prefix.
const DefaultImagePrefix = "images/"

// openImageBucket returns the bucket through which the image store shares
// images with the other hosts on the S3 bucket of an "s3" snapshot store
// (image.Store.SetBucket), nil for another kind of store. Like the snapshot
// store it starts while S3 does not answer. Errors: a bad configuration, or
// a bucket S3 says does not exist.
func openImageBucket(ctx context.Context, cfg StoreConfig, log *slog.Logger) (*image.Bucket, error) {
	if cfg.Kind != "s3" {
		return nil, nil
	}
	b, err := chunked.NewS3(ctx, chunked.S3Config{Endpoint: cfg.S3Endpoint, Bucket: cfg.S3Bucket,
		AccessKey: cfg.S3AccessKey, SecretKey: cfg.S3SecretKey, Region: cfg.S3Region, PathStyle: !cfg.S3VirtualHost})
	if err != nil {
		return nil, fmt.Errorf("image bucket: %w", err)
	}
	c, bucket := b.Client()
	prefix := cfg.S3ImagePrefix
	if prefix == "" {
		prefix = DefaultImagePrefix
	}
	return image.NewBucket(image.BucketConfig{Client: c, Bucket: bucket, Prefix: prefix, Logger: log})
}
