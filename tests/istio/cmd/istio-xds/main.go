// Command istio-xds runs Istio's own discovery server (istiod's xDS with its ambient
// index) over a fake Kubernetes cluster, so the end-to-end tests of ztunnel-rs
// (tests/src/istio_xds.rs) can check our ztunnel against what istiod really sends,
// not against our own idea of it (tests/src/fake_istiod.rs).
//
// Istio's code enters only as a Go module dependency: the server is the one Istio's
// own tests use (istio.io/istio/pilot/test/xds.NewFakeDiscoveryServer), fed with
// Kubernetes objects (Pods, Services, Namespaces, Gateways, AuthorizationPolicies ...)
// read from a multi-document YAML file, the way istiod reads them from a cluster.
//
// It serves gRPC over TLS (a server certificate the test makes, for
// istiod.istio-system.svc) and, like istiod on a connection whose client certificate it
// does not check, accepts any bearer token. With --ca-listen it also serves Istio's CA
// (ca.go): workload certificates signed with the test's root (--ca-cert, --ca-key) for
// the bearer tokens listed in --tokens, impersonation by the service accounts in
// CA_TRUSTED_NODE_ACCOUNTS checked by Istio's node authorizer. It prints
// "CA listening on <addr>" once that serves.
//
// Changes at run time come as lines on stdin:
//
//	apply <file>    create or update every object in <file>
//	delete <file>   delete every object named in <file>
//
// Each line is answered on stdout with "applied <file>" or "deleted <file>" (or
// "error <file>: <why>"). The server prints "listening on <addr>" once it serves.
package main

import (
	"bufio"
	"crypto/tls"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"

	corev1 "k8s.io/api/core/v1"
	kerrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"

	networkingv1 "istio.io/client-go/pkg/apis/networking/v1"
	securityv1 "istio.io/client-go/pkg/apis/security/v1"
	"istio.io/istio/pilot/pkg/features"
	"istio.io/istio/pilot/test/xds"
	"istio.io/istio/pkg/config/mesh"
	kubelib "istio.io/istio/pkg/kube"
	"istio.io/istio/pkg/kube/controllers"
	"istio.io/istio/pkg/kube/kclient"
)

// failer is the testing.TB that NewFakeDiscoveryServer wants: a failure ends the
// process (the Rust test sees it exit and reads the log), cleanups run at exit.
type failer struct {
	mu       sync.Mutex
	cleanups []func()
}

func (f *failer) Fail()    { f.FailNow() }
func (f *failer) FailNow() { f.exit(1) }
func (f *failer) Fatal(args ...any) {
	fmt.Fprintln(os.Stderr, append([]any{"fatal:"}, args...)...)
	f.exit(1)
}
func (f *failer) Fatalf(format string, a ...any) {
	fmt.Fprintf(os.Stderr, "fatal: "+format+"\n", a...)
	f.exit(1)
}
func (f *failer) Log(args ...any)              { fmt.Fprintln(os.Stderr, args...) }
func (f *failer) Logf(format string, a ...any) { fmt.Fprintf(os.Stderr, format+"\n", a...) }
func (f *failer) Helper()                      {}
func (f *failer) Skip(args ...any)             { f.Fatal(append([]any{"skip is not allowed:"}, args...)...) }
func (f *failer) TempDir() string {
	d, err := os.MkdirTemp("", "istio-xds")
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = os.RemoveAll(d) })
	return d
}

func (f *failer) Cleanup(fn func()) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cleanups = append(f.cleanups, fn)
}

func (f *failer) exit(code int) {
	f.mu.Lock()
	fns := f.cleanups
	f.cleanups = nil
	f.mu.Unlock()
	for i := len(fns) - 1; i >= 0; i-- {
		fns[i]()
	}
	os.Exit(code)
}

// applier creates, updates or deletes one kind of object in the fake cluster.
type applier func(obj runtime.Object, del bool) error

func writer[T controllers.ComparableObject](c kubelib.Client) applier {
	w := kclient.NewWriteClient[T](c)
	return func(obj runtime.Object, del bool) error {
		o := obj.(T)
		if del {
			return w.Delete(o.GetName(), o.GetNamespace())
		}
		if _, err := w.Create(o); err != nil {
			if !kerrors.IsAlreadyExists(err) {
				return err
			}
			if _, err := w.Update(o); err != nil {
				return err
			}
		}
		// The status (a Pod's IP and readiness, a Gateway's address) is a subresource:
		// set it as well, as the kubelet or the gateway controller would. Kinds without
		// a status subresource refuse, which is fine.
		_, _ = w.UpdateStatus(o)
		return nil
	}
}

func appliers(c kubelib.Client) map[string]applier {
	return map[string]applier{
		"Namespace":           writer[*corev1.Namespace](c),
		"Node":                writer[*corev1.Node](c),
		"Pod":                 writer[*corev1.Pod](c),
		"Service":             writer[*corev1.Service](c),
		"ServiceAccount":      writer[*corev1.ServiceAccount](c),
		"AuthorizationPolicy": writer[*securityv1.AuthorizationPolicy](c),
		"PeerAuthentication":  writer[*securityv1.PeerAuthentication](c),
		"ServiceEntry":        writer[*networkingv1.ServiceEntry](c),
		"WorkloadEntry":       writer[*networkingv1.WorkloadEntry](c),
		"Gateway":             writer[*gatewayv1.Gateway](c),
		"GatewayClass":        writer[*gatewayv1.GatewayClass](c),
		"HTTPRoute":           writer[*gatewayv1.HTTPRoute](c),
	}
}

// decode parses a multi-document YAML file into typed objects (Kubernetes, Istio and
// Gateway API kinds), as NewFakeDiscoveryServer does for KubernetesObjectString.
func decode(text string) ([]runtime.Object, error) {
	var out []runtime.Object
	d := kubelib.IstioCodec.UniversalDeserializer()
	for _, doc := range strings.Split(text, "\n---\n") {
		if strings.TrimSpace(doc) == "" {
			continue
		}
		o, _, err := d.Decode([]byte(doc), nil, nil)
		if err != nil {
			return nil, fmt.Errorf("decoding %q: %v", doc, err)
		}
		out = append(out, o)
	}
	return out, nil
}

func change(ap map[string]applier, path string, del bool) error {
	text, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	objs, err := decode(string(text))
	if err != nil {
		return err
	}
	for _, o := range objs {
		k := o.GetObjectKind().GroupVersionKind().Kind
		if k == "" {
			k = fmt.Sprintf("%T", o)
			k = k[strings.LastIndex(k, ".")+1:]
		}
		a, ok := ap[k]
		if !ok {
			return fmt.Errorf("kind %s is not supported at run time", k)
		}
		if err := a(o, del); err != nil {
			return fmt.Errorf("%s: %v", k, err)
		}
	}
	return nil
}

func main() {
	objects := flag.String("objects", "", "multi-document YAML file with the cluster's objects at start")
	listen := flag.String("listen", "127.0.0.1:15012", "address to serve xDS on (gRPC over TLS)")
	certFile := flag.String("cert", "", "server certificate chain (PEM)")
	keyFile := flag.String("key", "", "server private key (PEM)")
	meshFile := flag.String("mesh", "", "MeshConfig YAML applied over Istio's defaults (as istiod's mesh ConfigMap)")
	caListen := flag.String("ca-listen", "", "address to serve Istio's CA on (gRPC over TLS, the same serving certificate); none if empty")
	caCert := flag.String("ca-cert", "", "the CA's root certificate, which signs workload certificates (PEM)")
	caKey := flag.String("ca-key", "", "the root's private key (PEM)")
	tokens := flag.String("tokens", "", "the token table the fake cluster's TokenReviews answer from (see ca.go)")
	flag.Parse()

	// Istio reads PILOT_ENABLE_AMBIENT when its packages initialise and derives the
	// other ambient flags from it: without it there is no ambient index. Run again
	// with it set rather than half-enabling ambient by assigning variables.
	if !features.EnableAmbient {
		if os.Getenv("PILOT_ENABLE_AMBIENT") != "" {
			fmt.Fprintln(os.Stderr, "PILOT_ENABLE_AMBIENT is set but ambient is off")
			os.Exit(2)
		}
		self, err := os.Executable()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		err = syscall.Exec(self, os.Args, append(os.Environ(), "PILOT_ENABLE_AMBIENT=true"))
		fmt.Fprintln(os.Stderr, "re-exec with PILOT_ENABLE_AMBIENT=true:", err)
		os.Exit(2)
	}

	t := &failer{}
	if *objects == "" || *certFile == "" || *keyFile == "" {
		t.Fatal("--objects, --cert and --key are required")
	}
	text, err := os.ReadFile(*objects)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.LoadX509KeyPair(*certFile, *keyFile)
	if err != nil {
		t.Fatal(err)
	}
	tcp, err := net.Listen("tcp", *listen)
	if err != nil {
		t.Fatal(err)
	}
	// TLS is terminated on the listener: the fake server's gRPC server has no
	// credentials, so it sees a plaintext connection and, as istiod does for those,
	// authenticates nobody (any bearer token is accepted).
	ln := tls.NewListener(tcp, &tls.Config{
		Certificates: []tls.Certificate{cert},
		NextProtos:   []string{"h2"},
		MinVersion:   tls.VersionTLS12,
	})

	opts := xds.FakeOptions{
		KubernetesObjectString: string(text),
		ListenerBuilder:        func() (net.Listener, error) { return ln, nil },
	}
	if *meshFile != "" {
		y, err := os.ReadFile(*meshFile)
		if err != nil {
			t.Fatal(err)
		}
		if opts.MeshConfig, err = mesh.ApplyMeshConfig(string(y), mesh.DefaultMeshConfig()); err != nil {
			t.Fatal(err)
		}
	}
	s := xds.NewFakeDiscoveryServer(t, opts)
	ap := appliers(s.KubeClient())
	if *caListen != "" {
		if *caCert == "" || *caKey == "" || *tokens == "" {
			t.Fatal("--ca-listen needs --ca-cert, --ca-key and --tokens")
		}
		if len(features.CATrustedNodeAccounts) == 0 {
			t.Fatal("CA_TRUSTED_NODE_ACCOUNTS is not set: the CA would refuse every impersonated request")
		}
		m := opts.MeshConfig
		if m == nil {
			m = mesh.DefaultMeshConfig()
		}
		addr, err := serveCA(t, s.KubeClient(), m, caOptions{
			listen: *caListen, rootCert: *caCert, rootKey: *caKey, tokens: *tokens, serving: cert,
		})
		if err != nil {
			t.Fatal("Istio's CA: ", err)
		}
		fmt.Printf("CA listening on %s\n", addr)
	}

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-sig
		t.exit(0)
	}()

	fmt.Printf("listening on %s\n", tcp.Addr())
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		verb, path, _ := strings.Cut(strings.TrimSpace(in.Text()), " ")
		var err error
		switch verb {
		case "apply":
			err = change(ap, path, false)
		case "delete":
			err = change(ap, path, true)
		case "":
			continue
		default:
			err = fmt.Errorf("unknown command %q", verb)
		}
		if err != nil {
			fmt.Printf("error %s: %v\n", path, err)
		} else if verb == "apply" {
			fmt.Printf("applied %s\n", path)
		} else {
			fmt.Printf("deleted %s\n", path)
		}
	}
	// stdin closed: the test that started us is gone.
	t.exit(0)
}
