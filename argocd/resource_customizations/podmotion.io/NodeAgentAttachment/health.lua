-- Argo CD health of a NodeAgentAttachment (podmotion.io/v1alpha1).
-- Healthy: Ready (every admissible replica has a running agent).
-- Suspended: an ingest whose session lease expired (reason LeaseExpired): its Job was
--   released and it waits for the client to renew the Lease.
-- Degraded: any other Stalled reason (no admissible target, sidecar, port or agent
--   conflict, workload not found).
-- Progressing: Jobs being created or replaced, or a status for an older generation.
local hs = {}

local function condition(ctype)
  if obj.status ~= nil and obj.status.conditions ~= nil then
    for _, c in ipairs(obj.status.conditions) do
      if c.type == ctype then
        return c
      end
    end
  end
  return nil
end

local function describe(c, fallback)
  if c == nil then
    return fallback
  end
  local text = c.reason or fallback
  if c.message ~= nil and c.message ~= "" then
    text = text .. ": " .. c.message
  end
  return text
end

if obj.status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to pick up the attachment"
  return hs
end

local st = obj.status
local generation = obj.metadata.generation
if generation ~= nil and (st.observedGeneration == nil or st.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local stalled = condition("Stalled")
if stalled ~= nil and stalled.status == "True" then
  if stalled.reason == "LeaseExpired" then
    hs.status = "Suspended"
  else
    hs.status = "Degraded"
  end
  hs.message = describe(stalled, "Stalled")
  return hs
end

local ready = condition("Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready, "Ready")
  return hs
end

hs.status = "Progressing"
local reconciling = condition("Reconciling")
if reconciling ~= nil and reconciling.status == "True" then
  hs.message = describe(reconciling, "Reconciling")
elseif st.readySummary ~= nil then
  hs.message = st.readySummary .. " agents ready"
else
  hs.message = "Waiting for agents"
end
return hs
