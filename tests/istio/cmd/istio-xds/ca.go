package main

// Istio's CA, served beside the discovery server as istiod serves it: the
// IstioCertificateService of istio.io/istio/security/pkg/server/ca with an IstioCA
// (security/pkg/pki/ca) signing with the test's root, Istio's Kubernetes JWT
// authenticator (kubeauth.KubeJWTAuthenticator, the one istiod uses for bearer tokens)
// and Istio's node authorizer for impersonated requests (CA_TRUSTED_NODE_ACCOUNTS).
//
// The only stand-in is the Kubernetes API server's token authenticator: the fake
// cluster answers a TokenReview from a table the test writes (--tokens), one token a
// line:
//
//	<token> <namespace>/<service account> [<pod name>]
//
// A listed token reviews as the API server reviews a bound service-account token:
// authenticated, user system:serviceaccount:<namespace>:<service account> in group
// system:serviceaccounts, and, with a pod, the pod's name and uid (the uid read from the
// cluster's Pod) in the user's extra fields, which the node authorizer checks. Any other
// token reviews as not authenticated. The file is read at each review, so a test may
// add tokens while the server runs.

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	meshconfig "istio.io/api/mesh/v1alpha1"
	"istio.io/istio/pkg/cluster"
	"istio.io/istio/pkg/config/mesh/meshwatcher"
	kubelib "istio.io/istio/pkg/kube"
	"istio.io/istio/pkg/kube/multicluster"
	"istio.io/istio/pkg/security"
	"istio.io/istio/security/pkg/k8s/tokenreview"
	pkica "istio.io/istio/security/pkg/pki/ca"
	caserver "istio.io/istio/security/pkg/server/ca"
	"istio.io/istio/security/pkg/server/ca/authenticate/kubeauth"
)

// clusterID is istiod's default cluster name, the one the fake server uses.
const clusterID cluster.ID = "Kubernetes"

type caOptions struct {
	listen   string
	rootCert string
	rootKey  string
	tokens   string
	// The serving certificate (the same as the discovery server's).
	serving tls.Certificate
}

// reviewTokens makes the fake cluster answer TokenReviews from the token table.
func reviewTokens(c kubelib.Client, tokensFile string) error {
	cs, ok := c.Kube().(*fake.Clientset)
	if !ok {
		return fmt.Errorf("the cluster's client is %T, not a fake clientset", c.Kube())
	}
	cs.PrependReactor("create", "tokenreviews", func(a k8stesting.Action) (bool, runtime.Object, error) {
		review := a.(k8stesting.CreateAction).GetObject().(*authv1.TokenReview).DeepCopy()
		review.Status = authv1.TokenReviewStatus{Authenticated: false}
		f, err := os.Open(tokensFile)
		if err != nil {
			review.Status.Error = err.Error()
			return true, review, nil
		}
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			if len(fields) < 2 || fields[0] != review.Spec.Token {
				continue
			}
			ns, sa, ok := strings.Cut(fields[1], "/")
			if !ok {
				review.Status.Error = fmt.Sprintf("bad token table line %q", sc.Text())
				return true, review, nil
			}
			user := authv1.UserInfo{
				Username: fmt.Sprintf("system:serviceaccount:%s:%s", ns, sa),
				Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"},
			}
			if len(fields) > 2 {
				// From the tracker: reactors run under the clientset's lock, so the
				// clientset itself cannot be asked here.
				o, err := cs.Tracker().Get(corev1.SchemeGroupVersion.WithResource("pods"), ns, fields[2])
				if err != nil {
					review.Status.Error = fmt.Sprintf("token bound to pod %s/%s: %v", ns, fields[2], err)
					return true, review, nil
				}
				pod := o.(*corev1.Pod)
				user.Extra = map[string]authv1.ExtraValue{
					tokenreview.PodNameKey: {pod.Name},
					tokenreview.PodUIDKey:  {string(pod.UID)},
				}
			}
			review.Status.Authenticated = true
			review.Status.User = user
			review.Status.Audiences = review.Spec.Audiences
			return true, review, nil
		}
		return true, review, nil
	})
	return nil
}

// serveCA starts Istio's CA on o.listen. The node authorizer is built per cluster when
// the cluster is added to the multicluster controller, so the CA server is made first,
// then the cluster added, then the client's (new) informers started.
func serveCA(t *failer, c kubelib.Client, m *meshconfig.MeshConfig, o caOptions) (net.Addr, error) {
	if err := reviewTokens(c, o.tokens); err != nil {
		return nil, err
	}
	caOpts, err := pkica.NewPluggedCertIstioCAOptions(pkica.SigningCAFileBundle{
		RootCertFile:    o.rootCert,
		SigningCertFile: o.rootCert,
		SigningKeyFile:  o.rootKey,
	}, 24*time.Hour, 90*24*time.Hour, 2048)
	if err != nil {
		return nil, err
	}
	istioCA, err := pkica.NewIstioCA(caOpts)
	if err != nil {
		return nil, err
	}
	authn := kubeauth.NewKubeJWTAuthenticator(meshwatcher.NewTestWatcher(m), c.Kube(), clusterID, nil, nil)
	clusters := multicluster.NewFakeController()
	srv, err := caserver.New(istioCA, time.Hour, []security.Authenticator{authn}, clusters)
	if err != nil {
		return nil, err
	}
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	clusters.Add(clusterID, c, stop)
	c.RunAndWait(stop)

	ln, err := net.Listen("tcp", o.listen)
	if err != nil {
		return nil, err
	}
	g := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{
		Certificates: []tls.Certificate{o.serving},
		MinVersion:   tls.VersionTLS12,
	})))
	srv.Register(g)
	go func() { _ = g.Serve(ln) }()
	t.Cleanup(g.Stop)
	return ln.Addr(), nil
}
