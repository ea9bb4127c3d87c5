// Probe (2026-12-01, xla-cpu-pjrt 0.0.1, PJRT C API 0.81): can the CPU plugin run one program
// across several processes through PJRT's distributed runtime?
//
// Build: cc -O1 -I<venv>/site-packages/xla_plugins/xla_cpu_pjrt/include \
//          scripts/pjrt_multiprocess_probe.c -ldl -o /tmp/probe_mp
// Run:   /tmp/probe_mp .deps/pjrt_cpu_plugin.so opts
//        /tmp/probe_mp .deps/pjrt_cpu_plugin.so node 0 & /tmp/probe_mp .deps/pjrt_cpu_plugin.so node 1
// ("node" mode: num_nodes=2, node_id, cpu_device_count=1 and key-value callbacks backed by
// files under /tmp/dp_probe/kv, then a 2-replica all_reduce with one device per process.)
//
// Result:
// - `cpu_device_count` is honoured (2 -> 2 devices); every other option name (num_nodes,
//   node_id, collectives, even bogus_option) is accepted and silently ignored.
// - The key-value callbacks are never called (no put, no get), each process sees 1 global
//   device with process index 0, and compiling the 2-replica program fails in both processes
//   with "No matching device found for device_id 1".
// - Cause (XLA's xla/pjrt/c/pjrt_c_api_cpu_internal.cc): the CPU plugin's PJRT_Client_Create
//   builds its CpuClientOptions from `cpu_device_count` alone (newer versions also
//   `asynchronous`, `max_inflight_computations`, `pooling_allocator`); it never passes a
//   key-value store, process id or CPU collectives (gloo/MPI) to the client, so cross-process
//   CPU collectives are not reachable through the C API. The GPU plugin's PJRT_Client_Create
//   reads `node_id`, `num_nodes` and wraps the kv callbacks into its KeyValueStore (NCCL
//   clique ids and topology are exchanged through it).
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "pjrt_c_api.h"
static const PJRT_Api* api;
static int report(PJRT_Error* e, const char* w) {
  if (!e) { printf("%s: ok\n", w); return 0; }
  PJRT_Error_Message_Args m = {PJRT_Error_Message_Args_STRUCT_SIZE}; m.error = e; api->PJRT_Error_Message(&m);
  printf("%s: ERROR %.*s\n", w, (int)m.message_size, m.message); fflush(stdout); return 1;
}
static const char* KV = "/tmp/dp_probe/kv";
static void path_of(char* out, const char* key, size_t n) {
  char k[512]; size_t j = 0; for (size_t i = 0; i < n && j < 500; i++) k[j++] = (key[i] == '/' ? '_' : key[i]); k[j] = 0;
  snprintf(out, 1024, "%s/%s", KV, k);
}
static void del(char* v) { free(v); }
static PJRT_Error* kv_get(PJRT_KeyValueGetCallback_Args* a) {
  char p[1024]; path_of(p, a->key, a->key_size);
  fprintf(stderr, "[kv_get %.*s timeout %d]\n", (int)a->key_size, a->key, a->timeout_in_ms);
  for (int t = 0; t < a->timeout_in_ms / 10 + 1; t++) {
    FILE* f = fopen(p, "rb");
    if (f) { fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET); char* v = malloc(n + 1); fread(v, 1, n, f); fclose(f);
      a->value = v; a->value_size = n; a->value_deleter_callback = del; return NULL; }
    usleep(10000);
  }
  return (*a->callback_error)(PJRT_Error_Code_DEADLINE_EXCEEDED, "kv_get timeout", 14);
}
static PJRT_Error* kv_try_get(PJRT_KeyValueTryGetCallback_Args* a) {
  char p[1024]; path_of(p, a->key, a->key_size);
  FILE* f = fopen(p, "rb");
  if (!f) return (*a->callback_error)(PJRT_Error_Code_NOT_FOUND, "not found", 9);
  fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET); char* v = malloc(n + 1); fread(v, 1, n, f); fclose(f);
  a->value = v; a->value_size = n; a->value_deleter_callback = del; return NULL;
}
static PJRT_Error* kv_put(PJRT_KeyValuePutCallback_Args* a) {
  char p[1024], tmp[1100]; path_of(p, a->key, a->key_size); snprintf(tmp, sizeof tmp, "%s.tmp%d", p, getpid());
  fprintf(stderr, "[kv_put %.*s (%zu bytes)]\n", (int)a->key_size, a->key, a->value_size);
  FILE* f = fopen(tmp, "wb"); fwrite(a->value, 1, a->value_size, f); fclose(f); rename(tmp, p); return NULL;
}
static PJRT_NamedValue iv(const char* name, int64_t v) {
  PJRT_NamedValue nv = {PJRT_NamedValue_STRUCT_SIZE}; nv.name = name; nv.name_size = strlen(name); nv.type = PJRT_NamedValue_kInt64; nv.int64_value = v; nv.value_size = 1; return nv;
}
static PJRT_NamedValue sv(const char* name, const char* v) {
  PJRT_NamedValue nv = {PJRT_NamedValue_STRUCT_SIZE}; nv.name = name; nv.name_size = strlen(name); nv.type = PJRT_NamedValue_kString; nv.string_value = v; nv.value_size = strlen(v); return nv;
}
static PJRT_Client* create(PJRT_NamedValue* opts, size_t n, int kv, const char* what) {
  PJRT_Client_Create_Args cc = {PJRT_Client_Create_Args_STRUCT_SIZE}; cc.create_options = opts; cc.num_options = n;
  if (kv) { cc.kv_get_callback = kv_get; cc.kv_put_callback = kv_put; cc.kv_try_get_callback = kv_try_get; }
  if (report(api->PJRT_Client_Create(&cc), what)) return NULL;
  PJRT_Client_AddressableDevices_Args ad = {PJRT_Client_AddressableDevices_Args_STRUCT_SIZE}; ad.client = cc.client; api->PJRT_Client_AddressableDevices(&ad);
  PJRT_Client_Devices_Args d = {PJRT_Client_Devices_Args_STRUCT_SIZE}; d.client = cc.client; api->PJRT_Client_Devices(&d);
  PJRT_Client_ProcessIndex_Args pi = {PJRT_Client_ProcessIndex_Args_STRUCT_SIZE}; pi.client = cc.client; api->PJRT_Client_ProcessIndex(&pi);
  printf("  -> %zu addressable, %zu global devices, process index %d\n", ad.num_addressable_devices, d.num_devices, pi.process_index);
  return cc.client;
}
int main(int argc, char** argv) {
  void* h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL); api = ((const PJRT_Api* (*)(void))dlsym(h, "GetPjrtApi"))();
  printf("PJRT C API %d.%d\n", api->pjrt_api_version.major_version, api->pjrt_api_version.minor_version);
  PJRT_Plugin_Initialize_Args pi = {PJRT_Plugin_Initialize_Args_STRUCT_SIZE}; report(api->PJRT_Plugin_Initialize(&pi), "init");
  if (!strcmp(argv[2], "opts")) {
    create(NULL, 0, 0, "no options");
    PJRT_NamedValue o1[] = {iv("cpu_device_count", 2)}; create(o1, 1, 0, "cpu_device_count=2");
    PJRT_NamedValue o2[] = {iv("num_nodes", 2), iv("node_id", 0)}; create(o2, 2, 0, "num_nodes=2 node_id=0, no kv");
    PJRT_NamedValue o3[] = {iv("node_id", 0)}; create(o3, 1, 0, "node_id=0");
    PJRT_NamedValue o4[] = {iv("num_nodes", 1), iv("node_id", 0)}; create(o4, 2, 1, "num_nodes=1 node_id=0, kv");
    PJRT_NamedValue o5[] = {sv("collectives", "gloo")}; create(o5, 1, 0, "collectives=gloo");
    PJRT_NamedValue o6[] = {iv("bogus_option", 1)}; create(o6, 1, 0, "bogus_option=1");
    return 0;
  }
  int node = atoi(argv[3]);
  mkdir("/tmp/dp_probe/kv", 0755);
  PJRT_NamedValue o[] = {iv("num_nodes", 2), iv("node_id", node), iv("cpu_device_count", 1)};
  PJRT_Client* c = create(o, 3, 1, "num_nodes=2 with kv");
  if (!c) return 1;
  const char* code = "module @m attributes {mhlo.num_replicas = 2 : i32, mhlo.num_partitions = 1 : i32} { func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {\n"
    "  %0 = \"stablehlo.all_reduce\"(%a) ({\n  ^bb0(%x: tensor<f32>, %y: tensor<f32>):\n    %s = stablehlo.add %x, %y : tensor<f32>\n    stablehlo.return %s : tensor<f32>\n  }) {replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>, channel_handle = #stablehlo.channel_handle<handle = 1, type = 0>} : (tensor<4xf32>) -> tensor<4xf32>\n"
    "  return %0 : tensor<4xf32>\n } }";
  PJRT_Program p = {PJRT_Program_STRUCT_SIZE}; p.code = (char*)code; p.code_size = strlen(code); p.format = "mlir"; p.format_size = 4;
  char opts[] = {0x1a, 0x04, 0x20, 0x02, 0x28, 0x01};
  PJRT_Client_Compile_Args co = {PJRT_Client_Compile_Args_STRUCT_SIZE}; co.client = c; co.program = &p; co.compile_options = opts; co.compile_options_size = sizeof opts;
  if (report(api->PJRT_Client_Compile(&co), "compile 2 replicas over 2 processes")) return 1;
  PJRT_LoadedExecutable_AddressableDevices_Args ea = {PJRT_LoadedExecutable_AddressableDevices_Args_STRUCT_SIZE}; ea.executable = co.executable; report(api->PJRT_LoadedExecutable_AddressableDevices(&ea), "exe devices");
  printf("  executable addressable devices: %zu\n", ea.num_addressable_devices);
  float in[4] = {1 + node * 9, 2 + node * 18, 3 + node * 27, 4 + node * 36}; int64_t dims[1] = {4};
  PJRT_Client_BufferFromHostBuffer_Args bh = {PJRT_Client_BufferFromHostBuffer_Args_STRUCT_SIZE};
  bh.client = c; bh.data = in; bh.type = PJRT_Buffer_Type_F32; bh.dims = dims; bh.num_dims = 1;
  bh.host_buffer_semantics = PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes; bh.device = ea.addressable_devices[0];
  if (report(api->PJRT_Client_BufferFromHostBuffer(&bh), "h2d")) return 1;
  if (bh.done_with_host_buffer) { PJRT_Event_Await_Args aw = {PJRT_Event_Await_Args_STRUCT_SIZE}; aw.event = bh.done_with_host_buffer; api->PJRT_Event_Await(&aw); }
  PJRT_Buffer* a0[1] = {bh.buffer}; PJRT_Buffer* const* al[1] = {a0};
  PJRT_Buffer* o0[1] = {0}; PJRT_Buffer** ol[1] = {o0}; PJRT_Event* done[1] = {0};
  PJRT_ExecuteOptions eo = {PJRT_ExecuteOptions_STRUCT_SIZE};
  PJRT_LoadedExecutable_Execute_Args ex = {PJRT_LoadedExecutable_Execute_Args_STRUCT_SIZE};
  ex.executable = co.executable; ex.options = &eo; ex.argument_lists = al; ex.num_devices = 1; ex.num_args = 1; ex.output_lists = ol; ex.device_complete_events = done;
  if (report(api->PJRT_LoadedExecutable_Execute(&ex), "execute")) return 1;
  if (done[0]) { PJRT_Event_Await_Args aw = {PJRT_Event_Await_Args_STRUCT_SIZE}; aw.event = done[0]; if (report(api->PJRT_Event_Await(&aw), "await execute")) return 1; }
  float out[4]; PJRT_Buffer_ToHostBuffer_Args th = {PJRT_Buffer_ToHostBuffer_Args_STRUCT_SIZE}; th.src = ol[0][0]; th.dst = out; th.dst_size = sizeof out;
  if (report(api->PJRT_Buffer_ToHostBuffer(&th), "d2h")) return 1;
  if (th.event) { PJRT_Event_Await_Args aw = {PJRT_Event_Await_Args_STRUCT_SIZE}; aw.event = th.event; report(api->PJRT_Event_Await(&aw), "await d2h"); }
  printf("node %d: %g %g %g %g (want 11 22 33 44)\n", node, out[0], out[1], out[2], out[3]);
  return 0;
}
