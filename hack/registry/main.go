// The local registry (hack/registry.sh): distribution's cmd/registry with the one
// storage driver it is configured with, the filesystem. Upstream's main also links the
// Azure, GCS and S3 drivers, the CloudFront middleware, the token and htpasswd auth and
// pprof, which hack/registry.sh's configuration and e2e/tests/real_release.rs's TLS
// registry never use and which cost most of a cold build. Anything it adds to that
// configuration must be imported here too (the registry refuses a driver it lacks).
package main

import (
	"github.com/distribution/distribution/v3/registry"
	_ "github.com/distribution/distribution/v3/registry/storage/driver/filesystem"
)

func main() {
	// As upstream's main: the commands report their own errors and exit non-zero.
	_ = registry.RootCmd.Execute()
}
