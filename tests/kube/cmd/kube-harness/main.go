// kube-harness is one binary for the Kubernetes control plane the Rust e2e tests run
// (tests/src/kube_apiserver.rs): etcd, kube-apiserver and kube-controller-manager (for
// EndpointSlices: there are no kubelets, tests write pods' status), built from their Go
// modules (go.etcd.io/etcd/server/v3, k8s.io/kubernetes v1.37.2) so that they share one
// compile and one link. The first argument names the program; the rest are its flags.
package main

import (
	"fmt"
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: kube-harness etcd|kube-apiserver|kube-controller-manager [flags]")
		os.Exit(2)
	}
	prog, args := os.Args[1], os.Args[2:]
	switch prog {
	case "etcd":
		etcdmain.Main(append([]string{"etcd"}, args...))
	case "kube-apiserver":
		cmd := apiserver.NewAPIServerCommand()
		cmd.SetArgs(args)
		os.Exit(cli.Run(cmd))
	case "kube-controller-manager":
		cmd := controllermanager.NewControllerManagerCommand()
		cmd.SetArgs(args)
		os.Exit(cli.Run(cmd))
	default:
		fmt.Fprintf(os.Stderr, "kube-harness: unknown program %q (etcd, kube-apiserver, kube-controller-manager)\n", prog)
		os.Exit(2)
	}
}
