-- Max-min fair shares of `limit` over `n` holders (0-based), the twin of
-- `limiter::lease::fair_shares`: each its floor, then what is left shared
-- equally among those that want more, none given more than it wants, and
-- what nobody wants shared equally among all; ties go to the lower index.
-- Prepended to the scripts that share a limit out (lease.lua, quota.lua).
local function fair_shares(limit, n, floors, demands)
  local shares, wants = {}, {}
  local floor_sum = 0
  for i = 0, n - 1 do
    floor_sum = floor_sum + floors[i]
  end
  local left = math.max(0, limit - floor_sum)
  for i = 0, n - 1 do
    shares[i] = floors[i]
    wants[i] = math.max(0, demands[i] - floors[i])
  end
  while left > 0 do
    local wanting = {}
    for i = 0, n - 1 do
      if wants[i] > 0 then wanting[#wanting + 1] = i end
    end
    if #wanting == 0 then break end
    local even = math.floor(left / #wanting)
    if even == 0 then
      for j = 1, left do
        local i = wanting[j]
        shares[i] = shares[i] + 1
        wants[i] = wants[i] - 1
      end
      left = 0
      break
    end
    for _, i in ipairs(wanting) do
      local given = math.min(even, wants[i])
      shares[i] = shares[i] + given
      wants[i] = wants[i] - given
      left = left - given
    end
  end
  if left > 0 and n > 0 then
    local even, extra = math.floor(left / n), left % n
    for i = 0, n - 1 do
      shares[i] = shares[i] + even + ((i < extra) and 1 or 0)
    end
  end
  return shares
end

