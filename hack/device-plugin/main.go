// kvm-device-plugin: the local cluster's device plugin for the KVM device (RunnerPool's
// `kvmResourceName`). It advertises `--count` interchangeable slots of one character
// device (`--device`, default /dev/kvm) under `--resource-name` to the kubelet over the
// device-plugin API v1beta1 (registration on `<plugin-dir>/kubelet.sock`), and answers
// Allocate with a DeviceSpec for that device, read-write: the container runtime then
// creates the device in the container and grants it in the device cgroup. It grants no
// file-mode access: under `hostUsers: false` the device's owner is outside the pod's ID
// mapping, so the node's mode of the device decides (docs/runner-pool.md).
//
// The kubelet removes every socket in its plugin directory when it starts; the plugin
// notices its socket is gone and registers again. It reports the device Unhealthy while
// it is missing or is not a character device.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	device string
	count  int
	health chan string
}

func (p *plugin) devices(health string) []*pluginapi.Device {
	out := make([]*pluginapi.Device, p.count)
	for i := range out {
		out[i] = &pluginapi.Device{ID: fmt.Sprintf("kvm-%d", i), Health: health}
	}
	return out
}

// deviceHealth is Healthy when the device exists and is a character device.
func deviceHealth(path string) string {
	st, err := os.Stat(path)
	if err != nil || st.Mode()&os.ModeCharDevice == 0 {
		return pluginapi.Unhealthy
	}
	return pluginapi.Healthy
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, s grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	health := deviceHealth(p.device)
	if err := s.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices(health)}); err != nil {
		return err
	}
	for {
		select {
		case <-s.Context().Done():
			return nil
		case h := <-p.health:
			if h == health {
				continue
			}
			health = h
			log.Printf("%s is %s", p.device, h)
			if err := s.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices(health)}); err != nil {
				return err
			}
		}
	}
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		log.Printf("allocate %v: %s rw", c.DevicesIds, p.device)
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Devices: []*pluginapi.DeviceSpec{{ContainerPath: p.device, HostPath: p.device, Permissions: "rw"}},
		})
	}
	return resp, nil
}

func (p *plugin) GetPreferredAllocation(context.Context, *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	return &pluginapi.PreferredAllocationResponse{}, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

// serve listens on socket and registers with the kubelet; returns the server to stop.
func serve(p *plugin, dir, socket, resource string) (*grpc.Server, error) {
	path := filepath.Join(dir, socket)
	_ = os.Remove(path)
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go func() { _ = srv.Serve(l) }()
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "kubelet.sock"),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		srv.Stop()
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     socket,
		ResourceName: resource,
		Options:      &pluginapi.DevicePluginOptions{},
	})
	if err != nil {
		srv.Stop()
		return nil, fmt.Errorf("register with the kubelet: %w", err)
	}
	return srv, nil
}

func main() {
	resource := flag.String("resource-name", "devices.kubevirt.io/kvm", "extended resource name to advertise")
	device := flag.String("device", "/dev/kvm", "character device handed to containers (same path inside)")
	count := flag.Int("count", 110, "how many containers may hold the device at once")
	dir := flag.String("plugin-dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin directory")
	flag.Parse()
	if *count < 1 {
		log.Fatalf("--count must be at least 1")
	}
	socket := "podmotion-kvm.sock"
	p := &plugin{device: *device, count: *count, health: make(chan string, 1)}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	var srv *grpc.Server
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		// (Re-)register when our socket is gone: the kubelet restarted and cleared its
		// plugin directory (or has not answered yet).
		if _, err := os.Stat(filepath.Join(*dir, socket)); srv == nil || err != nil {
			if srv != nil {
				log.Printf("socket gone (kubelet restarted?): registering again")
				srv.Stop()
				srv = nil
			}
			s, err := serve(p, *dir, socket, *resource)
			if err != nil {
				log.Printf("%v; retrying", err)
			} else {
				srv = s
				log.Printf("registered %s (%d x %s) at %s", *resource, *count, *device, filepath.Join(*dir, socket))
			}
		}
		select {
		case p.health <- deviceHealth(*device):
		default:
		}
		select {
		case <-sigs:
			if srv != nil {
				srv.Stop()
			}
			_ = os.Remove(filepath.Join(*dir, socket))
			return
		case <-tick.C:
		}
	}
}
