// podmotion-argocd-health evaluates Argo CD health for Kubernetes objects with Argo CD's
// own code: the settings manager that parses the `resource.customizations.health.*` keys
// of argocd-cm (util/settings), the gopher-lua VM that runs the scripts (util/lua), and
// gitops-engine's GetResourceHealth, the function the application controller calls for
// every live object. It does what `argocd admin settings resource-overrides health`
// does for one file, for many objects at once, without building the whole CLI.
//
// Built by hack/build-argocd-health.sh (Argo CD version pinned in hack/versions.env);
// driven by e2e/tests/argocd_health.rs.
//
//	podmotion-argocd-health --argocd-cm CM.yaml < objects.json > results.json
//
// CM.yaml holds one ConfigMap whose data is merged into Argo CD's argocd-cm (the chart
// renders it with argocd.resourceCustomizations.enabled=true; its name does not matter).
// stdin is a JSON array of objects or a `kind: List` (kubectl get -o json); stdout is a
// JSON array with, for each object in order, {kind, namespace, name, status, message}
// or {..., error}. The exit status is 0 unless the input or the ConfigMap cannot be read.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/argoproj/gitops-engine/pkg/health"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/kubernetes/fake"
	"sigs.k8s.io/yaml"

	"github.com/argoproj/argo-cd/v3/common"
	"github.com/argoproj/argo-cd/v3/util/lua"
	"github.com/argoproj/argo-cd/v3/util/settings"
)

type result struct {
	Kind      string `json:"kind"`
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name"`
	Status    string `json:"status,omitempty"`
	Message   string `json:"message,omitempty"`
	Error     string `json:"error,omitempty"`
}

const namespace = "argocd"

func main() {
	cmPath := flag.String("argocd-cm", "", "YAML file with the ConfigMap whose data goes into argocd-cm")
	flag.Parse()
	if *cmPath == "" || flag.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: podmotion-argocd-health --argocd-cm CM.yaml < objects.json")
		os.Exit(2)
	}
	if err := run(*cmPath, os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "podmotion-argocd-health:", err)
		os.Exit(1)
	}
}

func run(cmPath string, in io.Reader, out io.Writer) error {
	ctx := context.Background()
	data, err := os.ReadFile(cmPath)
	if err != nil {
		return err
	}
	var cm corev1.ConfigMap
	if err := yaml.UnmarshalStrict(data, &cm); err != nil {
		return fmt.Errorf("%s: %w", cmPath, err)
	}
	if cm.Kind != "ConfigMap" {
		return fmt.Errorf("%s: kind %q, want ConfigMap", cmPath, cm.Kind)
	}
	// What `argocd admin settings` does with --argocd-cm-path (setSettingsMeta), and
	// the name Argo CD reads: the keys are meant to be merged into argocd-cm.
	cm.Name = common.ArgoCDConfigMapName
	cm.Namespace = namespace
	cm.Labels = map[string]string{"app.kubernetes.io/part-of": "argocd"}
	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name:      common.ArgoCDSecretName,
			Namespace: namespace,
			Labels:    map[string]string{"app.kubernetes.io/part-of": "argocd"},
		},
		Data: map[string][]byte{"admin.password": []byte("test"), "server.secretkey": []byte("test")},
	}
	manager := settings.NewSettingsManager(ctx, fake.NewClientset(secret, &cm), namespace)
	if err := manager.ResyncInformers(); err != nil {
		return err
	}
	overrides, err := manager.GetResourceOverrides()
	if err != nil {
		return fmt.Errorf("argocd-cm resource customizations: %w", err)
	}

	raw, err := io.ReadAll(in)
	if err != nil {
		return err
	}
	var objects []map[string]any
	if err := json.Unmarshal(raw, &objects); err != nil {
		var list struct {
			Kind  string           `json:"kind"`
			Items []map[string]any `json:"items"`
		}
		if err2 := json.Unmarshal(raw, &list); err2 != nil || list.Items == nil {
			return fmt.Errorf("stdin: want a JSON array of objects or a List: %w", err)
		}
		objects = list.Items
	}

	results := make([]result, 0, len(objects))
	for _, o := range objects {
		obj := unstructured.Unstructured{Object: o}
		r := result{Kind: obj.GetKind(), Namespace: obj.GetNamespace(), Name: obj.GetName()}
		// The application controller's call (controller/state.go, via
		// gitops-engine's health package), with the overrides from argocd-cm.
		hs, err := health.GetResourceHealth(&obj, lua.ResourceHealthOverrides(overrides))
		switch {
		case err != nil:
			r.Error = err.Error()
		case hs == nil:
			r.Error = fmt.Sprintf("no health check for %s", obj.GroupVersionKind().GroupKind())
		default:
			r.Status = string(hs.Status)
			r.Message = hs.Message
		}
		results = append(results, r)
	}
	enc := json.NewEncoder(out)
	enc.SetIndent("", "  ")
	return enc.Encode(results)
}
