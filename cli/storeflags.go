package cli

import (
	"os"

	"github.com/spf13/pflag"

	"github.com/torpor/torpor/server"
)

// storeFlagNames are the flags addStoreFlags defines.
var storeFlagNames = []string{"store", "s3-endpoint", "s3-bucket", "s3-access-key", "s3-secret-key", "s3-region", "s3-prefix", "snapshot-key", "snapshot-old-key"}

// addStoreFlags defines the snapshot store's flags on fs, filling sc: --store
// (help storeHelp) and the S3 connection, each defaulting to its TORPOR_*
// environment variable (docs/operations.md). `torpor serve` and the offline
// `torpor snapshot` commands share them.
func addStoreFlags(fs *pflag.FlagSet, sc *server.StoreConfig, storeHelp string) {
	fs.StringVar(&sc.Kind, "store", envOr("TORPOR_STORE", ""), storeHelp)
	fs.StringVar(&sc.S3Endpoint, "s3-endpoint", os.Getenv("TORPOR_S3_ENDPOINT"), "S3 endpoint for --store s3: http(s)://host:port (host:port means https)")
	fs.StringVar(&sc.S3Bucket, "s3-bucket", os.Getenv("TORPOR_S3_BUCKET"), "S3 bucket for --store s3 (must exist)")
	fs.StringVar(&sc.S3AccessKey, "s3-access-key", "", "S3 access key (default $TORPOR_S3_ACCESS_KEY, else $AWS_ACCESS_KEY_ID)")
	fs.StringVar(&sc.S3SecretKey, "s3-secret-key", "", "S3 secret key (default $TORPOR_S3_SECRET_KEY, else $AWS_SECRET_ACCESS_KEY)")
	fs.StringVar(&sc.S3Region, "s3-region", envOr("TORPOR_S3_REGION", "us-east-1"), "S3 region")
	fs.StringVar(&sc.S3Prefix, "s3-prefix", os.Getenv("TORPOR_S3_PREFIX"), "key prefix inside the bucket (e.g. torpor/)")
	fs.StringVar(&sc.KeyFile, "snapshot-key", os.Getenv("TORPOR_SNAPSHOT_KEY_FILE"), "file holding a 32-byte key (raw, hex or base64; readable by its owner only) that encrypts new snapshots at rest (chunked and s3 stores; docs/security.md)")
	fs.StringArrayVar(&sc.OldKeyFiles, "snapshot-old-key", nil, "key file of an earlier --snapshot-key: snapshots encrypted with it still resume (key rotation; repeatable)")
}

// fillS3Credentials takes the S3 keys the flags left empty from the
// environment: TORPOR_S3_ACCESS_KEY / TORPOR_S3_SECRET_KEY, else AWS's
// AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.
func fillS3Credentials(sc *server.StoreConfig) {
	if sc.S3AccessKey == "" {
		sc.S3AccessKey = envOr("TORPOR_S3_ACCESS_KEY", os.Getenv("AWS_ACCESS_KEY_ID"))
	}
	if sc.S3SecretKey == "" {
		sc.S3SecretKey = envOr("TORPOR_S3_SECRET_KEY", os.Getenv("AWS_SECRET_ACCESS_KEY"))
	}
}
