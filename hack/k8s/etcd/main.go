// Command etcd is the etcd server (go.etcd.io/etcd/server/v3), built from the version
// pinned in hack/versions.env for the local control plane (hack/cluster.sh).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
